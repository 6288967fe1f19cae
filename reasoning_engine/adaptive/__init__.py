"""Adaptive optimisation: the engine measures its own step costs and its workload's habits (draft acceptance, agents'
return gaps, batch sizes), decides speculation lengths, token budgets, KV retention and CUDA-graph sizes from them,
and keeps what it learned across restarts (controller.py)."""
