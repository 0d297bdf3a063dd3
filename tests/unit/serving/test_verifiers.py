"""The catalog verifier builder (`draftline make-verifier smollm2`) where its package is missing; the build itself
is tests/integration/test_verifier_build.py."""

import pytest

from draftline.errors import DataError
from draftline.serving.verifiers import CatalogVerifier, package_gguf


def test_a_missing_package_names_the_install_command():
    entry = CatalogVerifier(package="draftline-no-such-package", version="1.0", gguf_file="x.gguf",
                            serving_id="org/x", dir_name="x")
    with pytest.raises(DataError, match=r"draftline-no-such-package==1.0, which is not installed: ./setup.sh --real"):
        package_gguf(entry)
