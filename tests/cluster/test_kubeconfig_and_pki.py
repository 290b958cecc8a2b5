"""The generated kubeconfig loads in the Kubernetes client; the PKI chains and covers the right names."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

from copse.cluster.kubeconfig import CONTEXT, dump_kubeconfig, render_kubeconfig
from copse.cluster.pki import generate_pki, san_extension, token_file_line


def test_kubeconfig_loads_in_the_kubernetes_client_with_server_ca_and_token(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("unused by the loader until a request is made\n")
    path = tmp_path / "kubeconfig"
    path.write_text(
        dump_kubeconfig(render_kubeconfig(server="https://127.0.0.1:6443", ca_file=ca, token="abc123"))
    )
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    assert configuration.host == "https://127.0.0.1:6443"
    assert configuration.ssl_ca_cert == str(ca)
    assert list(configuration.api_key.values()) == ["Bearer abc123"]
    assert yaml.safe_load(path.read_text())["current-context"] == CONTEXT


def test_kubeconfig_refuses_a_plain_http_server(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="https://"):
        render_kubeconfig(server="http://127.0.0.1:8080", ca_file=tmp_path / "ca.crt", token="t")


def test_token_file_line_puts_the_admin_in_system_masters() -> None:
    assert token_file_line("t0k") == 't0k,copse-admin,copse-admin,"system:masters"\n'


def test_san_extension_covers_loopback_and_the_kubernetes_service() -> None:
    text = san_extension(service_ip="10.96.0.1")
    sans = text.splitlines()[0].removeprefix("subjectAltName=").split(",")
    assert {"IP:127.0.0.1", "IP:10.96.0.1", "DNS:kubernetes.default.svc"} <= set(sans)


def test_generated_serving_cert_verifies_against_the_generated_ca(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path / "pki", service_ip="10.96.0.1")
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(pki.ca_crt), "-purpose", "sslserver", str(pki.apiserver_crt)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(pki.apiserver_crt)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "IP Address:127.0.0.1" in text
    assert "IP Address:10.96.0.1" in text
    assert pki.token_file.read_text() == token_file_line(pki.token)
    assert pki.service_account_key.stat().st_mode & 0o077 == 0
