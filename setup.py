"""eb_deepspeed: cross-layer load balancing for Mixture-of-Experts models in DeepSpeed.

Install (CPU):  bash launch/setup_cpu.sh      (pins torch==2.13.0 first, then `pip install -e .[test,wandb,plots,megatron,hf]`)
Install (GPU):  pip install -e .              (with the CUDA torch your cluster already has)
"""
from setuptools import find_packages, setup

setup(
    name="eb-deepspeed",
    version="0.1.0",
    description="Cross-layer load balancing (EasyBalance) for DeepSpeed (MoE and AutoEP) / Megatron-Core MoE models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["eb_deepspeed", "eb_deepspeed.*"]),
    python_requires=">=3.10",
    # torch is deliberately a range, not a pin: a GPU cluster keeps its own CUDA build.
    # The CPU install path (launch/setup_cpu.sh) installs torch==2.13.0 before this package.
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.19.4,<0.20",
        "numpy",
        "tqdm",
    ],
    extras_require={
        # scipy: the exact LP judge in benchmarks/; trl: its SFTTrainer under tests/test_trainer.py
        "test": ["pytest>=7", "matplotlib", "hypothesis", "scipy", "trl==1.16.0"],
        "wandb": ["wandb"],
        "plots": ["matplotlib"],
        "megatron": ["megatron-core==0.16.1"],   # the version tests/megatron_shim.py was checked with
        # Hugging Face MoE models under DeepSpeed's AutoEP: DeepSpeed 0.19.8's AutoEP fails with transformers >= 5.23;
        # accelerate: the Hugging Face Trainer's door to DeepSpeed
        "hf": ["transformers==5.22.2", "accelerate==1.15.0"],
    },
    entry_points={"console_scripts": ["eb=eb_deepspeed.tools.cli:main"]},
)
