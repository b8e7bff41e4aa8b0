"""The real-vLLM test tier (`make test-vllm`): tests against a real vLLM 0.32 on the CPU."""
