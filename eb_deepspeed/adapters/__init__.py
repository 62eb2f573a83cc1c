"""Adapters: glue between the framework-neutral core and a training/serving framework.

`common` is the kit they share (one `attach` recipe); `deepspeed` (DeepSpeed-MoE's `MoE` layers), `autoep`
(Hugging Face models converted by DeepSpeed's AutoEP) and `megatron` (Megatron-Core's router) hold what differs;
`serving` is the framework-neutral serving engine over the slot stores of `deepspeed` and `autoep`, and
`init_inference`, the one door to it."""

__all__ = []   # the kit and the adapters are subpackages: `adapters.deepspeed`, `adapters.autoep`, ...
