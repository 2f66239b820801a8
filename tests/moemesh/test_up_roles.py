"""`moemesh up --roles ...` (part of the mesh per host) and `moemesh etcd` (a cluster member):
flags, defaults and the usage errors that name the value; no process is started."""

import pytest

from moemesh import cli, etcd, launcher


def spec(model_dir, *argv) -> launcher.MeshSpec:
    args = cli.build_parser().parse_args(["up", "--model", str(model_dir), *argv])
    return cli.mesh_spec(args, str(model_dir))


def test_default_is_the_whole_mesh_with_plain_member_ids(tiny_model_dir):
    whole = spec(tiny_model_dir)
    assert whole.roles == launcher.ALL_ROLES and whole.member_tag == "" and whole.bind_host == ""
    mesh = launcher.Mesh(whole)
    assert mesh._member_id("expert-1") == "expert-1" and mesh.dial_host == "127.0.0.1"


def test_roles_on_one_host_tag_their_member_ids_with_its_address(tiny_model_dir):
    experts = spec(tiny_model_dir, "--roles", "expert", "--ranks", "2", "--etcd", "127.0.0.1:2379,127.0.0.2:2379",
                   "--bind-host", "127.0.0.3", "--ep-interface", "lo")
    assert (experts.roles, experts.num_ranks, experts.member_tag) == (("expert",), 2, "127-0-0-3")
    mesh = launcher.Mesh(experts)
    mesh.etcd_endpoint = experts.etcd
    assert mesh._member_id("expert-1") == "expert-127-0-0-3-1"
    assert mesh._common_args() == ["--etcd", "127.0.0.1:2379,127.0.0.2:2379", "--bind-host", "127.0.0.3"]
    assert mesh.dial_host == "127.0.0.3"
    control = spec(tiny_model_dir, "--roles", "gateway,scheduler,router", "--etcd", "127.0.0.1:2379",
                   "--advertise-host", "127.0.0.2", "--member-tag", "a")
    assert (control.roles, control.advertise_host, control.member_tag) == (("gateway", "scheduler", "router"),
                                                                          "127.0.0.2", "a")


def test_ranks_must_divide_the_experts_only_where_it_is_the_group_size(tiny_model_dir):
    with pytest.raises(ValueError, match="--ranks 3 does not divide the 8 experts"):
        spec(tiny_model_dir, "--ranks", "3")
    with pytest.raises(ValueError, match="--ranks 3 does not divide the 8 experts"):
        spec(tiny_model_dir, "--ranks", "3", "--roles", "scheduler", "--etcd", "127.0.0.1:2379")
    # three of a group of four on this host, the fourth elsewhere
    assert spec(tiny_model_dir, "--ranks", "3", "--roles", "expert", "--etcd", "127.0.0.1:2379").num_ranks == 3


@pytest.mark.parametrize("argv,needle", [
    (["--roles", "expert"], "without etcd in --roles, give --etcd HOST:PORT"),
    (["--roles", "expert,brain", "--etcd", "127.0.0.1:2379"], "--roles must be a non-empty list of "
                                                              "etcd,scheduler,router,expert,gateway"),
    (["--roles", "etcd,scheduler", "--etcd", "127.0.0.1:2379"], "--roles includes etcd but --etcd 127.0.0.1:2379"),
    (["--roles", "etcd,scheduler", "--tls"], "--tls makes a throwaway CA for one host's mesh"),
])
def test_bad_roles_are_refused_naming_the_value(tiny_model_dir, argv, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        spec(tiny_model_dir, *argv, "--member-tag", "t")


def test_up_refuses_bad_roles_with_status_2(tiny_model_dir, capsys):
    assert cli.main(["up", "--model", str(tiny_model_dir), "--roles", "expert"]) == 2
    assert "moemesh up: without etcd in --roles" in capsys.readouterr().err


@pytest.mark.parametrize("cluster,needle", [
    ("n2=http://127.0.0.2:2380,n3=http://127.0.0.3:2380", "has no member named 'n1'"),
    ("n1=http://127.0.0.9:2380,n2=http://127.0.0.2:2380", "gives n1 the peer URL 'http://127.0.0.9:2380', but this "
                                                          "member listens for peers at 'http://127.0.0.1:2380'"),
])
def test_etcd_member_refuses_an_initial_cluster_without_it(tmp_path, cluster, needle, capsys):
    code = cli.main(["etcd", "--name", "n1", "--listen-host", "127.0.0.1", "--data-dir", str(tmp_path),
                     "--initial-cluster", cluster])
    assert code == 2 and needle in capsys.readouterr().err
    with pytest.raises(ValueError, match="no member named|peer URL"):
        etcd.start_member(tmp_path, name="n1", initial_cluster=cluster, listen_host="127.0.0.1")
