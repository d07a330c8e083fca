from setuptools import find_packages, setup

setup(
    name="megatron_rlhf",
    version="0.1.0",
    description="RLHF training of Llama-family models on megatron-core: speculative "
    "generation and parameter reallocation",
    packages=find_packages(include=["megatron_rlhf", "megatron_rlhf.*"]),
    package_data={"megatron_rlhf": ["data/*.jsonl"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16,<0.17",
        "numpy",
        "transformers>=4.56",
        "safetensors",
        "gguf",
        "accelerate",
        "sentencepiece",
        "tqdm",
        "psutil",  # megatron-core's checkpoint writer imports it (undeclared there)
        "tensorboard",
        "matplotlib",
        "math-verify==0.9.0",  # --reward-fn math: the verifier open-r1, TRL and verl use
        "pyarrow",  # --prompts FILE.parquet
    ],
    extras_require={"test": ["pytest>=8", "pytest-timeout"]},
)
