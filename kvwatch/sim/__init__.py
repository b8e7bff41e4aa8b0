"""A simulated vLLM 0.32 engine for demos and tests: an engine model (paged KV
blocks, prefix cache, scheduler, timing), a workload, scenarios of timed phases,
a renderer of vLLM's exact `/metrics` text and an OpenAI-compatible server.

    from kvwatch.sim.server import start_background   # a live server in-process
    from kvwatch.sim.scenario import load_scenario
    from kvwatch.sim.simulation import Simulation      # no wall time: sim.advance(60)
"""
