from setuptools import find_packages, setup

setup(
    name="tdmesh",
    version="0.1.0",
    description="A single-controller runtime for PyTorch: drive a torchrun fleet as one device",
    packages=find_packages(include=["tdmesh", "tdmesh.*"]),
    python_requires=">=3.11",
    # torch.distributed.elastic (the old torchelastic) ships inside torch.
    install_requires=["torch>=2.11"],
    extras_require={"test": ["pytest", "hypothesis", "cloudpickle"]},
    entry_points={"console_scripts": ["tdmesh-worker=tdmesh.worker.__main__:main"]},
)
