from setuptools import find_packages, setup

setup(
    name="tdmesh",
    version="0.1.0",
    description="A single-controller runtime for PyTorch: drive a torchrun fleet as one device",
    packages=find_packages(include=["tdmesh", "tdmesh.*"]),
    package_data={"tdmesh.monitor": ["page.html"]},  # the dashboard's one static page
    python_requires=">=3.11",
    # torch.distributed.elastic (the old torchelastic) ships inside torch.  numpy: torch warns in
    # every process without it, and mesh/rank arrays are ndarrays; cloudpickle ships functions
    # that have no import path (closures, the user's script) to the workers.
    install_requires=["torch>=2.11", "numpy", "cloudpickle"],
    # expecttest: torch.testing._internal (the OpInfo database of the conformance test) imports it;
    # transformers: real models (tiny configs, random weights) that tests train eagerly and compiled;
    # pytest-xdist: the suite runs its files on 2 processes (pytest.ini), most of a fleet test is waiting;
    # 3.8 brought --no-loadscope-reorder, which keeps the longest files first (tests/conftest.py)
    extras_require={"test": ["pytest", "pytest-xdist>=3.8", "hypothesis", "expecttest", "transformers", "ruff==0.17.6",
                             "mypy==2.4.1"]},
    entry_points={"console_scripts": ["tdmesh-worker=tdmesh.worker.__main__:main"]},
)
