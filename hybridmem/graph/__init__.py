"""The offline model: the Graph IR, Plan, units, cost models, capture and the simulator."""
