"""Packaging for gputq: the library plus its two lower layers, transport and kernels.

The repository keeps ``transport/`` and ``kernels/`` at its top, but they are
installed and imported as ``gputq.transport`` and ``gputq.kernels`` only:
generic top-level names would collide with other packages (PyPI's
``kernels`` among them).
"""

from setuptools import find_packages, setup

LOWER_LAYERS = {"gputq.transport": "transport", "gputq.kernels": "kernels"}

setup(
    name="gputq",
    version="0.1.0",
    description="Tensor-native transfer layer for large per-token RL rollout fields (R3 expert IDs, logprobs)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["gputq", "gputq.*"]) + sorted(LOWER_LAYERS),
    package_dir=LOWER_LAYERS,
    package_data={"gputq.kernels": ["*.cu", "*.c", "*.h"]},
    install_requires=["numpy>=1.24", "msgpack>=1.0", "pyyaml>=6"],
    extras_require={
        "ray": ["ray>=2.40"],
        "rdma": ["nixl-cu12==1.5.1"],
        "gpu": ["cupy-cuda12x"],
        "metrics": ["prometheus_client>=0.17"],
        # NVRTC alone (no driver needed) lets the tests compile the CUDA kernel where no GPU is.
        # megatron-core: the tests feed its RouterReplay the streamed slices (it needs only numpy and
        # packaging once torch is there; the Makefile installs torch first).
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6", "ray>=2.40", "prometheus_client>=0.17",
                "megatron-core==0.16.1",
                "nvidia-cuda-nvrtc-cu12>=12.4; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        # python -m bench.memory / bench.peers: the peer systems, their runtime, Ray's grpc client
        # (object-store gauge) and the figures. On a dev box that wants Ray minimal, install
        # transferqueue with --no-deps: its ray[default] requirement only adds the dashboard.
        # Mooncake Store: the non-CUDA wheel (0.3.13's store library links libcudart), published for
        # x86_64 Linux; it loads the system's libibverbs (apt install libibverbs1).
        "bench": ["transferqueue==0.1.11", "tensordict>=0.10", "pyzmq", "hydra-core", "omegaconf",
                  "msgspec", "psutil", "prometheus_client>=0.20", "grpcio", "matplotlib>=3.7",
                  "mooncake-transfer-engine-non-cuda==0.3.13.post1; "
                  "platform_system == 'Linux' and platform_machine == 'x86_64'"],
    },
    entry_points={"console_scripts": ["gputq=gputq.tools.cli:main"]},
)
