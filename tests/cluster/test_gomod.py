"""The wrapper go.mod that builds Kubernetes from the module proxy, generated from a release go.mod."""

from __future__ import annotations

import pytest
import yaml

from copse.cluster.gomod import (
    VERSION_PACKAGES,
    join_yaml_documents,
    kube_version_ldflags,
    parse_release_gomod,
    render_simple_gomod,
    render_wrapper_gomod,
)
from copse.cluster.versions import Versions

# Shape of k8s.io/kubernetes's go.mod (abridged): requires at v0.0.0, staging mapped to ./staging.
RELEASE_GOMOD = """\
// This is a generated file. Do not edit directly.

module k8s.io/kubernetes

go 1.24.0

godebug default=go1.24

require (
\tgithub.com/spf13/cobra v1.9.1
\tk8s.io/api v0.0.0
\tk8s.io/apimachinery v0.0.0
\tk8s.io/kubectl v0.0.0
)

require (
\tk8s.io/cri-client v0.0.0 // indirect
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/apimachinery => ./staging/src/k8s.io/apimachinery
\tk8s.io/cri-client => ./staging/src/k8s.io/cri-client
\tk8s.io/kubectl => ./staging/src/k8s.io/kubectl
)
"""


def test_parse_reads_go_directive_godebug_and_every_staging_module() -> None:
    release = parse_release_gomod(RELEASE_GOMOD)
    assert release.go == "1.24.0"
    assert release.godebug == ("default=go1.24",)
    assert release.staging == ("k8s.io/api", "k8s.io/apimachinery", "k8s.io/cri-client", "k8s.io/kubectl")


def test_parse_accepts_single_line_replaces_and_godebug_blocks() -> None:
    text = (
        "module k8s.io/kubernetes\n\ngo 1.25.0\n\ngodebug (\n\tdefault=go1.25\n\twinsymlink=0\n)\n\n"
        "replace k8s.io/api => ./staging/src/k8s.io/api\n"
        "replace github.com/other/mod => github.com/fork/mod v1.0.0\n"
    )
    release = parse_release_gomod(text)
    assert release.go == "1.25.0"
    assert release.godebug == ("default=go1.25", "winsymlink=0")
    assert release.staging == ("k8s.io/api",)


def test_parse_names_the_file_when_it_is_not_the_kubernetes_gomod() -> None:
    with pytest.raises(ValueError, match=r"/cache/etcd/go\.mod: no 'k8s\.io/\.\.\. => \./staging"):
        parse_release_gomod("module go.etcd.io/etcd\n\ngo 1.24\n", source="/cache/etcd/go.mod")
    with pytest.raises(ValueError, match="no 'go' directive"):
        parse_release_gomod("module x\n")


def test_wrapper_pins_every_staging_module_to_the_release_staging_tag() -> None:
    versions = Versions(kubernetes="v1.34.4")
    text = render_wrapper_gomod(
        module="local/copse-kubernetes",
        release=parse_release_gomod(RELEASE_GOMOD),
        requires={"k8s.io/kubernetes": versions.kubernetes},
        staging_version=versions.staging,
    )
    assert text == (
        "module local/copse-kubernetes\n\n"
        "go 1.24.0\n\n"
        "godebug default=go1.24\n\n"
        "require (\n\tk8s.io/kubernetes v1.34.4\n)\n\n"
        "replace (\n"
        "\tk8s.io/api => k8s.io/api v0.34.4\n"
        "\tk8s.io/apimachinery => k8s.io/apimachinery v0.34.4\n"
        "\tk8s.io/cri-client => k8s.io/cri-client v0.34.4\n"
        "\tk8s.io/kubectl => k8s.io/kubectl v0.34.4\n"
        ")\n"
    )


def test_simple_wrapper_has_module_and_go_only() -> None:
    assert render_simple_gomod(module="local/copse-etcd", go="1.24") == "module local/copse-etcd\n\ngo 1.24\n"


def test_version_ldflags_set_the_release_in_both_version_packages() -> None:
    flags = kube_version_ldflags(version="v1.34.4", minor="34", build_date="2026-01-01T00:00:00Z").split(
        " -X "
    )
    assert flags[0] == "-s -w"
    for package in VERSION_PACKAGES:
        assert f"{package}.gitVersion=v1.34.4" in flags
        assert f"{package}.gitMajor=1" in flags
        assert f"{package}.gitMinor=34" in flags
        assert f"{package}.gitTreeState=clean" in flags
        assert f"{package}.buildDate=2026-01-01T00:00:00Z" in flags


def test_versions_derive_staging_tag_minor_and_a_distinct_cache_key() -> None:
    versions = Versions(kubernetes="v1.33.7")
    assert versions.staging == "v0.33.7"
    assert versions.kube_minor == "33"
    assert versions.key != Versions().key
    with pytest.raises(ValueError, match=r"v1\.<minor>\.<patch>"):
        Versions(kubernetes="1.34")


def test_stage_documents_join_into_one_stream() -> None:
    stream = join_yaml_documents(
        ["kind: Stage\nmetadata: {name: a}\n", "kind: Stage\nmetadata: {name: b}\n\n"]
    )
    names = [doc["metadata"]["name"] for doc in yaml.safe_load_all(stream)]
    assert names == ["a", "b"]
    with pytest.raises(ValueError, match="empty YAML document"):
        join_yaml_documents(["kind: Stage", "\n"])
