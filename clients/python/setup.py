"""The build hook: generates the gRPC stubs (`balanceroute.v1.*_pb2`, `*_pb2_grpc`) from the
repository's proto/ with grpcio-tools while the package is built, so the wheel always matches
the contracts it was built from and nothing generated is committed.

Where the .proto files come from, first found wins:
1. $BALANCEROUTE_PROTO_DIR (a directory holding balanceroute/v1/*.proto);
2. proto/ beside this file (an sdist: `sdist` copies them there);
3. ../../proto (building from the repository: `pip install ./clients/python`).
"""

import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_PACKAGE = os.path.join("balanceroute", "v1")


def proto_dir():
    candidates = [
        os.environ.get("BALANCEROUTE_PROTO_DIR"),
        os.path.join(HERE, "proto"),
        os.path.join(HERE, "..", "..", "proto"),
    ]
    for c in candidates:
        if c and glob.glob(os.path.join(c, PROTO_PACKAGE, "*.proto")):
            return os.path.abspath(c)
    raise SystemExit(
        "balanceroute: no balanceroute/v1/*.proto found (looked in $BALANCEROUTE_PROTO_DIR, "
        f"{candidates[1]}, {os.path.abspath(candidates[2])}); build from the repository "
        "(pip install ./clients/python) or set BALANCEROUTE_PROTO_DIR"
    )


def generate(out_dir):
    """Runs grpcio-tools' protoc on every balanceroute/v1 proto into out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    src = proto_dir()
    files = sorted(
        os.path.join(PROTO_PACKAGE, os.path.basename(f))
        for f in glob.glob(os.path.join(src, PROTO_PACKAGE, "*.proto"))
    )
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    os.makedirs(out_dir, exist_ok=True)
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{src}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *files,
        ]
    )
    if code != 0:
        raise SystemExit(f"balanceroute: protoc failed with {code} on {files} from {src}")


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        # An editable install imports from src/, so the stubs go there (ignored by git).
        out = os.path.join(HERE, "src") if self.editable_mode else self.build_lib
        generate(out)


class SdistWithProtos(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        # The sdist must build on its own, away from the repository: carry the contracts.
        src = proto_dir()
        dst = os.path.join(base_dir, "proto", PROTO_PACKAGE)
        os.makedirs(dst, exist_ok=True)
        for f in glob.glob(os.path.join(src, PROTO_PACKAGE, "*.proto")):
            shutil.copy2(f, dst)


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos})
