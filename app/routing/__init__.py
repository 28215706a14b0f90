"""Pure routing core (no Ray): prefix index, affinity policy, load-only baselines. See api.py for the contract."""
