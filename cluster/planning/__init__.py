"""Capacity planning: profile the real engine, model step times (fitted or roofline),
simulate pools on a workload, search configurations under SLOs, validate against real runs."""
