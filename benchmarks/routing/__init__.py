"""Simulated-scale routing benchmark: a seeded workload generator, a discrete-event simulator of N replicas
built from the real Scheduler and KVCacheManager, the routers it compares, and the hit-rate bounds.

    python -m benchmarks.routing.simulator --replicas 8 --pressure 0.75 --load 1.0
"""
