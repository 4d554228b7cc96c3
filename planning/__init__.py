"""Capacity planning: profile the real engine (profile.py, serving_profile.py), model step
times (latency.py fitted, roofline.py + hardware.py for GPUs), simulate pools on a workload
(simulator.py, sim_engine.py, sim_runs.py), search configurations under SLOs (search.py), and
validate predictions against real runs (validate.py). Imports the cluster runtime to measure and the
router's placement policies to simulate; never bench.
"""
