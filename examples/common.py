"""What the examples print last: one JSON line to compare runs by (losses, parameters, hybridmem's figures)."""
from __future__ import annotations

import hashlib

import torch


def summary(model: torch.nn.Module, losses: list[float]) -> dict:
    """Losses, a hash of the parameters' bytes, and hybridmem's figures when it is enabled."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    out: dict = {"losses": losses, "params": h.hexdigest()[:16]}
    import hybridmem  # enabled by HYBRIDMEM_BUDGET at `import torch`, or not at all

    if hybridmem.enabled():
        st = hybridmem.stats()
        out["hybridmem"] = {"budget": st.budget_bytes, "peak": st.peak_bytes, "saved": st.saved_bytes,
                            "evicted": st.evicted_bytes, "steps": st.steps}
    return out
