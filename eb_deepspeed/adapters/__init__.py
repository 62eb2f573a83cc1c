"""Adapters: glue between the framework-neutral core and a training/serving framework.

`common` is the kit they share; `deepspeed` (DeepSpeed-MoE's `MoE` layers, serving), `autoep` (Hugging Face
models converted by DeepSpeed's AutoEP) and `megatron` (Megatron-Core's router) hold what differs; `serving`
is the one `init_inference` that sends a model to the serving of its kind."""
