"""Adapters: glue between the framework-neutral core and a framework: `common` (the kit they share), `deepspeed`,
`autoep`, `megatron` (what differs), `serving` (the engine over the slot stores of `deepspeed` and `autoep`)."""

__all__ = []   # the kit and the adapters are subpackages: `adapters.deepspeed`, `adapters.autoep`, ...
