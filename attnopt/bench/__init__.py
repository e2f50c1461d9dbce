"""Benchmark suites behind ``attnopt bench``; results follow the format in DESIGN.md."""
