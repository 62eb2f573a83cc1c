"""Adapters: glue between the framework-neutral core and a training/serving framework.
`deepspeed` is built; Megatron-Core's adapter will sit beside it."""
