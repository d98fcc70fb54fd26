"""Benchmarks of etcd_rdzv's rendezvous beside PyTorch's own handlers.

Run ``python3 -m benchmarks.run --help`` from the repository root; see
``docs/benchmarks.md`` for the results and how they were made.
"""
