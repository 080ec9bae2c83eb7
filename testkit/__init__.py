"""What the tests (tests/) and the benchmarks (bench/) share: real things to run them
against. Not part of the server or the SDK, and never shipped."""
