"""``python -m tdmesh.certs DIR``: a CA and a certificate for a trial TLS job (docs/SECURITY.md)."""

from __future__ import annotations

import os


def make_certificates(directory: str) -> dict[str, str]:
    """A CA and one certificate it signs, for every process of a job to share (tests, benches,
    a trial run): ``{"TDMESH_TLS_CERT": ..., "TDMESH_TLS_KEY": ..., "TDMESH_TLS_CA": ...}``.
    Uses the ``openssl`` command.  A real deployment signs one certificate per host with its
    own CA; the CA's key (``ca.key``) must stay off the job's machines."""
    import subprocess
    os.makedirs(directory, exist_ok=True)
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    with open(path("node.ext"), "w") as f:
        f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyAgreement\n"
                "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for args in (["req", "-x509", *ec, "-keyout", path("ca.key"), "-out", path("ca.pem"), "-days", "30",
                  "-subj", "/CN=tdmesh job CA", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                 ["req", *ec, "-keyout", path("node.key"), "-out", path("node.csr"), "-subj", "/CN=tdmesh node"],
                 ["x509", "-req", "-in", path("node.csr"), "-CA", path("ca.pem"), "-CAkey", path("ca.key"),
                  "-CAcreateserial", "-out", path("node.pem"), "-days", "30", "-extfile", path("node.ext")]):
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    os.chmod(path("node.key"), 0o600)
    return {"TDMESH_TLS_CERT": path("node.pem"), "TDMESH_TLS_KEY": path("node.key"), "TDMESH_TLS_CA": path("ca.pem")}


if __name__ == "__main__":  # python -m tdmesh.certs DIR: certificates for a trial TLS job
    import argparse
    parser = argparse.ArgumentParser(prog="python -m tdmesh.certs", description=make_certificates.__doc__)
    parser.add_argument("directory", nargs="?", default="tdmesh-tls", help="where to write them (default tdmesh-tls)")
    for name, value in make_certificates(parser.parse_args().directory).items():
        print(f"export {name}={value}")
