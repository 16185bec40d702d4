"""Tests of the benchmark harness (benchmarks/) and the developer tools
(tools/), apart from the library's own tests."""
