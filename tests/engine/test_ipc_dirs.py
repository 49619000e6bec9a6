"""The engine client's socket directories: one per process, named for it, and removed by a later
client once that process is gone (core_client.remove_stale_ipc_dirs)."""

from __future__ import annotations

import os
import subprocess

from ferry.engine.core_client import new_ipc_dir, remove_stale_ipc_dirs


def test_only_this_users_directories_of_dead_processes_are_removed(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process number no process has now
    dead = tmp_path / f"ferry-ipc-{gone.pid}-a1b2c3"
    alive = tmp_path / f"ferry-ipc-{os.getpid()}-d4e5f6"
    older = tmp_path / "ferry-ipc-x7y8z9"  # the old names carried no process: left alone
    for d in (dead, alive, older):
        d.mkdir()
        (d / "input").write_text("")
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"ferry-ipc-{gone.pid}-link00"
    link.symlink_to(target)  # a link is never followed, nor removed
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and older.exists() and link.is_symlink() and target.is_dir()
    assert remove_stale_ipc_dirs(str(tmp_path)) == []


def test_a_new_directory_is_private_and_named_for_this_process():
    path = new_ipc_dir()
    try:
        assert os.path.basename(path).startswith(f"ferry-ipc-{os.getpid()}-")
        assert os.stat(path).st_mode & 0o777 == 0o700
        assert path not in remove_stale_ipc_dirs()  # this process lives
    finally:
        os.rmdir(path)
