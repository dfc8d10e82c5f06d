"""The model runtime: a Llama-family model over a paged KV cache (model, attention, kv_cache,
block_manager, rope), what one pass runs (batch, lean_inputs), the runner that keeps each request's
sequence (runner, generate), loading weights and named models (loader, model_config, model_store,
quant, random_model), and the fast passes: the compiled CPU operators (kernels, lean_model) and CUDA
graphs (cuda_graphs).

May import `specserve.shared.spec` and `specserve.shared.process`; never the wire, the host or a service.
"""
