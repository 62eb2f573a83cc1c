"""Benchmark and reference code that is not part of the package (never imported by `eb_deepspeed`).

`eplb_port` is a port of DeepSeek's published EPLB algorithm, kept here to compare against;
`exact` solves the steered max load exactly (a linear program); `plan_vs_eplb` runs both side by side.
"""
