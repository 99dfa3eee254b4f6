"""returnn_tpu: RETURNN TensorFlow configs on many devices through tf.distribute (local SGD by default)."""

from setuptools import find_packages, setup

setup(
    name="returnn_tpu",
    version="0.1.0",
    description="Train RETURNN TensorFlow configs with local SGD on GPUs, clusters and TPUs via tf.distribute",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["returnn_tpu", "returnn_tpu.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Tested with returnn 1.20261022; the TF backend internals used here change rarely.
        "returnn>=1.20250101,<1.20280000",
        "numpy",
        "dm-tree",
        "threadpoolctl",  # one BLAS thread in the data producer (producer_process.one_math_thread)
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.16,<2.22"],
        "gpu": ["tensorflow[and-cuda]>=2.16,<2.22"],
        # Cloud TPU VMs: TensorFlow's TPU build (newest 2.20) and, for named TPUs on GCE, the client.
        "tpu": ["tensorflow-tpu>=2.16,<2.21", "cloud-tpu-client"],
        "mpi": ["mpi4py>=3.1"],  # SGE / mpirun clusters (cluster_resolver "mpi", "sge")
        # RETURNN's OggZipDataset reads Ogg files (soundfile) and computes MFCC / log-mel (librosa).
        "speech": ["soundfile", "librosa"],
        "test": ["pytest>=7", "pytest-xdist>=3.2", "mpi4py>=3.1", "nbclient", "nbformat", "ipykernel", "matplotlib",
                 "soundfile", "librosa", "scipy"],
    },
    entry_points={"console_scripts": ["returnn-tpu=returnn_tpu.cli:main"]},
)
