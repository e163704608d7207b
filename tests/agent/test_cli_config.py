"""gpufleet-agent's flags, GPUFLEET_* environment, TOML config file, precedence, errors, modes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support import BIN, REPO

from gpufleet.agent import __version__, modes, settings
from gpufleet.agent.config import COLLECTORS, DEFAULT_LISTEN, AgentConfig

AGENT = str(BIN / "gpufleet-agent")


def resolve(argv: list[str], env: dict[str, str] | None = None) -> settings.Settings:
    return settings.resolve(argv, env or {})


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    return subprocess.run([AGENT, *args], env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_defaults() -> None:
    s = resolve([])
    assert s.mode == "serve"
    assert s.config == AgentConfig()
    assert s.config.listen_address == DEFAULT_LISTEN
    assert all(s.config.enabled(c) for c in COLLECTORS)


def test_flags() -> None:
    s = resolve([
        "--web.listen-address=127.0.0.1:9999", "--web.telemetry-path", "/m", "--no-collector.nic",
        "--collector.jobs.mapping-dir=/tmp/jm", "--path.sysfs=/x/sys", "--log.level=debug", "--nvml.fake=sim:2",
        "--scrape.cache-seconds=1.5", "--web.config.file=/etc/w.yml",
    ])
    c = s.config
    assert (c.listen_address, c.telemetry_path, c.job_mapping_dir, c.sysfs_path, c.log_level, c.nvml_fake) == (
        "127.0.0.1:9999", "/m", "/tmp/jm", "/x/sys", "debug", "sim:2")
    assert c.cache_seconds == 1.5 and c.web_config_file == "/etc/w.yml"
    assert not c.enabled("nic") and c.enabled("gpu")


def test_last_collector_flag_wins() -> None:
    assert resolve(["--no-collector.gpu", "--collector.gpu"]).config.enabled("gpu")
    assert not resolve(["--collector.gpu", "--no-collector.gpu"]).config.enabled("gpu")


def test_environment() -> None:
    s = resolve([], {"GPUFLEET_WEB_LISTEN_ADDRESS": "[::1]:9500", "GPUFLEET_COLLECTOR_NIC": "false",
                     "GPUFLEET_COLLECTOR_HOST": "0", "GPUFLEET_NVML_FAKE": "sim",
                     "GPUFLEET_COLLECTOR_JOBS_MAPPING_DIR": "/jm", "GPUFLEET_SCRAPE_CACHE_SECONDS": "2"})
    c = s.config
    assert c.listen_address == "[::1]:9500" and c.nvml_fake == "sim" and c.job_mapping_dir == "/jm"
    assert not c.enabled("nic") and not c.enabled("host") and c.enabled("gpu")
    assert c.cache_seconds == 2.0


def write_toml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_config_file_and_precedence(tmp_path: Path) -> None:
    f = write_toml(tmp_path / "agent.toml", """
[web]
listen_address = "127.0.0.1:1111"
telemetry_path = "/from-file"
[collectors]
gpu = false
xid = false
[collector.jobs]
mapping_dir = "/file/jobs"
[path]
sysfs = "/file/sys"
[log]
level = "warn"
[nvml]
fake = "sim:1"
""")
    file_only = resolve([f"--config.file={f}"]).config
    assert file_only.listen_address == "127.0.0.1:1111" and file_only.telemetry_path == "/from-file"
    assert not file_only.enabled("gpu") and not file_only.enabled("xid") and file_only.enabled("nic")
    assert file_only.job_mapping_dir == "/file/jobs" and file_only.sysfs_path == "/file/sys"
    assert file_only.log_level == "warn" and file_only.nvml_fake == "sim:1"

    env = {"GPUFLEET_WEB_LISTEN_ADDRESS": "127.0.0.1:2222", "GPUFLEET_COLLECTOR_GPU": "true",
           "GPUFLEET_CONFIG_FILE": f}
    with_env = resolve([], env).config  # config file named by the environment
    assert with_env.listen_address == "127.0.0.1:2222"  # env beats file
    assert with_env.enabled("gpu") and not with_env.enabled("xid")
    assert with_env.telemetry_path == "/from-file"

    with_flag = resolve(["--web.listen-address=127.0.0.1:3333", "--no-collector.gpu"], env).config
    assert with_flag.listen_address == "127.0.0.1:3333"  # flag beats env
    assert not with_flag.enabled("gpu")


def test_subcommand_flags_and_textfile(tmp_path: Path) -> None:
    s = resolve(["--nvml.fake=sim", "textfile", "--directory", str(tmp_path), "--interval=0", "--no-collector.host"])
    assert s.mode == "textfile" and s.config.textfile_directory == str(tmp_path)
    assert s.config.textfile_interval == 0.0 and s.config.nvml_fake == "sim" and not s.config.enabled("host")
    s = resolve(["textfile"], {"GPUFLEET_TEXTFILE_DIRECTORY": str(tmp_path)})
    assert s.config.textfile_interval == AgentConfig().textfile_interval


@pytest.mark.parametrize(
    ("argv", "env", "toml", "needle"),
    [
        (["--bogus"], {}, None, "unrecognized arguments: --bogus"),
        (["--web.listen-address=localhost"], {}, None, "invalid listen address"),
        (["--web.listen-address=:99999"], {}, None, "port out of range"),
        (["--web.listen-address=::1:9445"], {}, None, "[addr]:port"),
        (["--web.telemetry-path=metrics"], {}, None, "invalid telemetry path"),
        (["--log.level=loud"], {}, None, "invalid log level"),
        (["--scrape.cache-seconds=-1"], {}, None, "--scrape.cache-seconds"),
        ([], {"GPUFLEET_COLLECTOR_NIC": "maybe"}, None, "GPUFLEET_COLLECTOR_NIC"),
        ([], {"GPUFLEET_SCRAPE_CACHE_SECONDS": "soon"}, None, "GPUFLEET_SCRAPE_CACHE_SECONDS"),
        ([], {}, "[web]\nlisten_adress = ':1'\n", "unknown key 'listen_adress'"),
        ([], {}, "[collectors]\ngpus = false\n", "unknown collector"),
        ([], {}, "[collectors]\ngpu = 'nah'\n", "[collectors] gpu"),
        ([], {}, "[webb]\nx = 1\n", "unknown section [webb]"),
        ([], {}, "listen_address = ':1'\n", "must be inside a [section]"),
        ([], {}, "[web\n", "invalid TOML"),
        ([], {}, "[web]\nlisten_address = 9445\n", "expected a string"),
        (["--collector.gpu.slow-interval=-5"], {}, None, "--collector.gpu.slow-interval"),
        ([], {"GPUFLEET_COLLECTOR_GPU_SLOW_INTERVAL": "often"}, None, "GPUFLEET_COLLECTOR_GPU_SLOW_INTERVAL"),
        ([], {}, "[collector.gpu]\nslow_interval = 'x'\n", "[collector.gpu] slow_interval"),
        (["textfile"], {}, None, "needs --directory"),
        (["textfile", "--directory=/nonexistent/dir"], {}, None, "does not exist"),
    ],
)
def test_bad_input_is_a_usage_error(tmp_path: Path, argv: list[str], env: dict[str, str], toml: str | None,
                                    needle: str) -> None:
    if toml is not None:
        argv = [*argv, f"--config.file={write_toml(tmp_path / 'a.toml', toml)}"]
    with pytest.raises(settings.UsageError) as e:
        resolve(argv, env)
    assert needle in str(e.value)


def test_gpu_slow_interval_flag_environment_and_file(tmp_path: Path) -> None:
    assert resolve([]).config.gpu_slow_interval == 30.0  # dcgm-exporter's default collection interval
    assert resolve(["--collector.gpu.slow-interval=0"]).config.gpu_slow_interval == 0.0
    env = {"GPUFLEET_COLLECTOR_GPU_SLOW_INTERVAL": "45"}
    assert resolve([], env).config.gpu_slow_interval == 45.0
    f = write_toml(tmp_path / "a.toml", "[collector.gpu]\nslow_interval = 2.5\n")
    assert resolve([f"--config.file={f}"]).config.gpu_slow_interval == 2.5
    assert resolve([f"--config.file={f}"], env).config.gpu_slow_interval == 45.0  # env beats the file
    # --collector.gpu still toggles the collector, and is not taken for the interval flag.
    s = resolve(["--no-collector.gpu", "--collector.gpu.slow-interval", "5"]).config
    assert not s.enabled("gpu") and s.gpu_slow_interval == 5.0
    assert "--collector.gpu.slow-interval" in settings.build_parser().format_help()


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(settings.UsageError, match="cannot read config file"):
        resolve([f"--config.file={tmp_path / 'none.toml'}"])


def test_process_exit_codes(tmp_path: Path) -> None:
    r = run("--no-such-flag")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpufleet-agent: error:") and "--no-such-flag" in lines[0]
    r = run(env={"GPUFLEET_COLLECTOR_GPU": "perhaps"})
    assert r.returncode == 2 and "GPUFLEET_COLLECTOR_GPU" in r.stderr
    r = run("--nvml.fake=nonsense", "--web.listen-address=127.0.0.1:0")
    assert r.returncode == 2 and "nonsense" in r.stderr, r.stderr
    bad = tmp_path / "web.yml"
    bad.write_text("tls_server_config:\n  cert_file: /nonexistent.pem\n  key_file: /nonexistent.key\n")
    r = run(f"--web.config.file={bad}", "--web.listen-address=127.0.0.1:0", "--nvml.fake=sim")
    assert r.returncode == 2 and "file not found" in r.stderr
    r = run("--version")
    assert r.returncode == 0 and __version__ in r.stdout
    r = run("--help")
    assert r.returncode == 0 and "--web.listen-address" in r.stdout and "GPUFLEET_WEB_LISTEN_ADDRESS" in r.stdout


def test_once_prints_the_exposition() -> None:
    r = run("once", "--nvml.fake=sim:2", "--no-collector.host", "--no-collector.nic")
    assert r.returncode == 0, r.stderr
    assert 'gpufleet_gpu_up{gpu="1"} 1.0' in r.stdout and 'gpu="2"' not in r.stdout
    assert 'gpufleet_scrape_collector_success{collector="gpu"} 1.0' in r.stdout
    assert 'collector="host"' not in r.stdout and 'collector="nic"' not in r.stdout


def test_textfile_once_writes_atomically(tmp_path: Path) -> None:
    stale = tmp_path / "gpufleet.prom"
    stale.write_text("old\n")
    r = run("textfile", f"--directory={tmp_path}", "--interval=0", "--nvml.fake=sim:1")
    assert r.returncode == 0, r.stderr
    text = stale.read_text()
    assert text.startswith("# HELP") and 'gpufleet_gpu_up{gpu="0"} 1.0' in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpufleet.prom"]  # no temp files left behind
    assert oct(stale.stat().st_mode & 0o777) == "0o644"  # node_exporter must be able to read it


def test_textfile_loop_rewrites_and_stops_on_sigterm(tmp_path: Path) -> None:
    import signal
    import time

    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env = {**clean, "GPUFLEET_TEXTFILE_DIRECTORY": str(tmp_path), "GPUFLEET_TEXTFILE_INTERVAL": "0.2"}
    proc = subprocess.Popen([AGENT, "textfile", "--nvml.fake=sim:1"], env=env, stderr=subprocess.PIPE)
    try:
        target = tmp_path / "gpufleet.prom"
        deadline = time.monotonic() + 30
        seen: set[int] = set()
        while time.monotonic() < deadline and len(seen) < 2:
            if target.exists():
                seen.add(target.stat().st_ino)  # each write is a new file renamed into place
            time.sleep(0.05)
        assert len(seen) >= 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def test_record_is_wired_with_global_settings(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    # --nvml.fake comes from the environment here: the CLI resolves it and passes it to the recorder.
    r = run("record", f"--output={out}", "--samples=2", "--interval=0.05", env={"GPUFLEET_NVML_FAKE": "sim:1"})
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and '"gpufleet-trace"' in lines[0]
    r = run("record", "--bogus-option", env={"GPUFLEET_NVML_FAKE": "sim:1"})
    assert r.returncode == 2


def test_packaged_agent_toml_shows_the_default_slow_interval() -> None:
    path = REPO / "packaging" / "agent.toml"
    assert resolve([f"--config.file={path}"]).config.gpu_slow_interval == resolve([]).config.gpu_slow_interval == 30


def test_tune_gc_freezes_startup_objects_and_raises_the_young_threshold() -> None:
    import gc

    before = gc.get_threshold()
    try:
        modes.tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (modes.GC_GEN0_THRESHOLD, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_python_dash_m_runs_the_agent() -> None:
    import sys

    r = subprocess.run([sys.executable, "-m", "gpufleet.agent.cli", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and __version__ in r.stdout, r.stderr


def test_record_takes_the_agent_log_level_in_any_case() -> None:
    from gpufleet.agent.recorder import build_parser

    cfg = resolve(["--log.level=WARNING", "--nvml.fake=sim:1"]).config
    args = modes.record_args(cfg, ["--output=t.jsonl"])
    assert args == ["--nvml.fake=sim:1", "--path.sysfs=/sys", "--log.level=warning", "--output=t.jsonl"]
    assert build_parser().parse_args(args).log_level == "warning"  # the recorder accepts every agent level
