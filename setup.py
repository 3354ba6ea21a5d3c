from setuptools import find_packages, setup

setup(
    name="autoparallel",
    version="0.1.0",
    description="Semi-automatic parallel training for paddle: meshes, placements, SPMD rules, "
                "cost-driven resharding, hybrid DP/TP/SP/PP/ZeRO runtime and an automatic planner.",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["autoparallel", "autoparallel.*", "spmd_rules", "spmd_rules.*",
                                    "reshard", "reshard.*"]),
    install_requires=["numpy", "networkx", "tqdm", "scipy", "matplotlib"],
    extras_require={
        # paddle is an extra so a GPU user's paddlepaddle-gpu is never replaced
        "cpu": ["paddlepaddle>=3.3,<3.4"],
        # pytest.ini uses pythonpath (pytest 7); xdist runs the suite on two workers (make test)
        "test": ["pytest>=7", "hypothesis", "pytest-xdist"],
        # real models from the ecosystem's library, run unedited by tests/test_paddleformers*.py
        "models": ["paddleformers==1.2.*"],
    },
    entry_points={"console_scripts": ["autoparallel=autoparallel.cli:main"]},
)
