"""The benchmark scripts, one per question; run from the repository root as modules, e.g.
`python -m benchmarks.engine_throughput` or `python -m benchmarks.routing.simulator`. Not installed with the
package: it lives in the checkout beside the tests."""
