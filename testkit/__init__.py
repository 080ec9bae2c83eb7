"""What the tests (tests/) and the benchmarks (bench/) share: real things to run them
against. Not part of the server or the SDK, and never shipped.

* ``ports``: free loopback ports;
* ``server``: an ec-cache server process (``ServerProcess``);
* ``s3``: a SeaweedFS S3 endpoint (``seaweedfs_endpoint``), or the tests' external one;
* ``fault_proxy``: an HTTP proxy that counts requests and breaks them on purpose;
* ``entries``: safetensors bodies built without the SDK;
* ``polling``: waiting, bounded, for a process to reach a state;
* ``qwen2vl``: a random-weight Qwen2-VL built offline;
* ``vllm_engine``: real vLLM engines and API servers with the connector.
"""
