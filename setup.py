"""The compiled parts of lmdbfolder, optional: everything else is in pyproject.toml.

``lmdbfolder.read._crops`` links the system libjpeg (Debian/Ubuntu:
``apt-get install libjpeg-dev``) to decode only a crop's region of a JPEG, and
resizes the crop with Pillow's exact bilinear arithmetic straight into the
batch. Where there is no compiler or no libjpeg headers the build skips it with
a warning and lmdbfolder decodes whole images and resizes them with Pillow
(the same pixels, slower: the default path is ~1.2x ImageFolder instead of
~1.5x); ``repr(dataset)`` says ``crop regions: on`` or ``off``, and
``lmdbfolder.read.regions.region_available()`` why.

``lmdbfolder.torch._photometric`` (no library needed) runs the multi-crop's
photometric operations on the CPU with Pillow's arithmetic; without it they run as
torch tensor operations (the same values, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmdbfolder.read._crops",
            ["src/lmdbfolder/read/_crops.c"],
            libraries=["jpeg"],
            # The resize must round as Pillow's does: no fused multiply-adds.
            # -O3: the resize's row loops vectorise.
            extra_compile_args=["-ffp-contract=off", "-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "lmdbfolder.torch._photometric",
            ["src/lmdbfolder/torch/_photometric.c"],
            # Pillow's float32 rounding, step by step: no fused multiply-adds.
            extra_compile_args=["-ffp-contract=off", "-fno-trapping-math", "-O3"],
            optional=True,
        ),
    ]
)
