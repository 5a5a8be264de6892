"""What the compiled backend leaves free for the compiler and how often it plans again: measured constants.

Read as ``tuning.NAME`` where used, so that a benchmark or test setting one sees it take effect.
"""

# The margins' measurements: docs/benchmarks.md, "Measured constants and design choices".
# Inductor's compiled step holds more at its peak than the joint graph counts op by op (its kernels'
# buffers live by kernel, not by op, and it orders the backward and the recomputed ops its own way): up to
# 9.3 % of the keep-all peak beside convolutions. Its plans leave this share of the keep-all peak free (of the
# lower of the region's two counts).
INDUCTOR_MARGIN = 0.11
# Where a region that convolves concatenates feature maps (a U-Net's skips), Inductor's layout optimization
# holds more (14 % of U-Net's keep-all count beyond the plan's count).
INDUCTOR_MARGIN_CONCAT = 0.17
# Without convolutions (transformers, MLPs) the graph fuses the backward's pointwise chains as Inductor
# does, and Inductor's step stayed below the count: a smaller share is left free there.
INDUCTOR_MARGIN_NO_CONV = 0.02
# plans judged by the partition they get (realized_peak), beyond the first, bisecting for the highest
# budget that fits: each costs a plan and a partition of a copy of the joint graph (GPT small: 1.1 s)
REALIZED_PROBES = 4
REALIZED_HEADROOM = 0.02    # ... only where the first plan's judged peak leaves this share of the budget free
REALIZED_TIME_SHARE = 2.0   # ... and for at most twice the time the first plan and its judgement took


# a compiled region whose step, run once at compile time (hybridmem.compile.trial), holds more than its share is
# planned again with the margin raised by the excess and this share of its keep-all peak, up to this many times;
# where the run was stopped at the share (CPU: it would have held more), the excess is only a least, and the
# share added doubles with each stopped run
REPLANS = 3
REPLAN_SLACK = 0.01
# where no plan fits with the margin but the least budget named is within it, the region is planned with the
# margin lowered by the difference (its run at compile time checks it), at most this many times
SHRINKS = 3

# compress a saved tensor only where its lossless encoding, measured on the example inputs, is at most this
# share of its bytes: a ReLU's output with half its elements zero encodes to 0.53 of a float32 tensor
COMPRESS_MAX_RATIO = 0.75
