"""Shared plumbing of bench/run and bench/recovery (Python 3 standard library only).

Processes, a local broker, topics, eos-bridge configurations, /proc sampling of CPU time and peak
RSS, and progress tracking. Nothing here decides what is measured; run and recovery do.
"""

import datetime
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
# EOS_BRIDGE_BENCH_RELEASE swaps every binary a tool runs (the bridge and the copiers) for another
# build's, e.g. bench/librdkafka/build's: a whole run then measures that build, ratios and all.
RELEASE_OVERRIDE = os.environ.get("EOS_BRIDGE_BENCH_RELEASE")
RELEASE = os.path.abspath(RELEASE_OVERRIDE) if RELEASE_OVERRIDE else os.path.join(ROOT, "target", "release")
BRIDGE_BIN = os.path.join(RELEASE, "eos-bridge")
EXAMPLES = os.path.join(RELEASE, "examples")
KSTREAMS_DIR = os.path.join(BENCH, "kstreams")
KAFKA_SCRIPT = os.path.join(ROOT, "scripts", "kafka")
KAFKA_CACHE = os.environ.get("EOS_BRIDGE_KAFKA_CACHE", os.path.join(ROOT, ".cache", "kafka"))
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def now_ms():
    return time.time() * 1000.0


def rand_suffix(n=6):
    return "".join(random.choice(string.ascii_lowercase + string.digits) for _ in range(n))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------------------------------------
# /proc sampling


def _stat_cpu(path):
    """(name, utime + stime in seconds) from a /proc stat file, or None when it is gone."""
    try:
        with open(path) as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return data[data.index("(") + 1:data.rindex(")")], (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid):
    """utime + stime of a live process, in seconds (None when it is gone)."""
    stat = _stat_cpu(f"/proc/{pid}/stat")
    return stat and stat[1]


# Thread names (as /proc shows them, trailing digits cut) grouped by what they do in the bridge
# and in the examples: the reading and sending thread, the producer's delivery reports, librdkafka's
# own threads of every client, the tokio runtime (HTTP); anything else is "other".
THREAD_GROUPS = (("pipe", ("eos-bridge-pipe", "txn_copy", "raw_copy")),
                 ("dr", ("producer pollin",)),
                 ("rdk", ("rdk:",)),
                 ("rt", ("eos-bridge-rt",)))


def thread_cpu_seconds(pid):
    """utime + stime of a live process's threads, summed by group (THREAD_GROUPS, "other") and
    "total" (the process's, so that threads already gone count as "other"); {} when it is gone."""
    total = cpu_seconds(pid)
    if total is None:
        return {}
    out = {g: 0.0 for g, _ in THREAD_GROUPS}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        stat = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        if stat is None:
            continue  # the thread ended between the listing and the read
        name, cpu = stat[0].rstrip("0123456789-"), stat[1]
        group = next((g for g, prefixes in THREAD_GROUPS if name.startswith(prefixes)), None)
        if group:
            out[group] += cpu
    out["other"] = max(0.0, total - sum(out.values()))
    out["total"] = total
    return out


def status_kb(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_mb(pid):
    kb = status_kb(pid, "VmHWM")
    return None if kb is None else kb / 1024.0


def rss_mb(pid):
    kb = status_kb(pid, "VmRSS")
    return None if kb is None else kb / 1024.0


class Sampler:
    """Keeps the last /proc reading of a process, so that its totals survive its exit."""

    def __init__(self, pid, period=0.2):
        self.pid = pid
        self.cpu = cpu_seconds(pid) or 0.0
        self.hwm = peak_rss_mb(pid) or 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._t.start()

    def _run(self, period):
        while not self._stop.wait(period):
            self.sample()

    def sample(self):
        c = cpu_seconds(self.pid)
        if c is not None:
            self.cpu = c
        h = peak_rss_mb(self.pid)
        if h is not None:
            self.hwm = max(self.hwm, h)
        return self.cpu

    def stop(self):
        self._stop.set()


# ---------------------------------------------------------------------------------------------
# Builds


def build(skip=False, kstreams=True):
    # --skip-build skips only cargo (the binaries under test, e.g. for an A/B): the Kafka Streams
    # jar and Kafka itself are still made when missing, or every C3 run of a new machine fails.
    if not skip:
        if RELEASE_OVERRIDE:
            # cargo would build target/release, not the directory the run measures.
            raise SystemExit(f"EOS_BRIDGE_BENCH_RELEASE={RELEASE_OVERRIDE} names a build made elsewhere: "
                             "add --skip-build")
        log("build: cargo build --release --examples --bin eos-bridge")
        subprocess.run(["cargo", "build", "--release", "--quiet", "--examples", "--bin", "eos-bridge"],
                       cwd=ROOT, check=True)
    # Every bench tool that builds, measures the bridge: each says which build, built or skipped.
    built = provenance()
    log(provenance_line(built))
    if not kstreams:
        subprocess.run([KAFKA_SCRIPT, "fetch"], check=True, stdout=subprocess.DEVNULL)
        return built
    jar = os.path.join(KSTREAMS_DIR, "target", "eos-bench-kstreams-0.jar")
    src = os.path.join(KSTREAMS_DIR, "src", "main", "java", "eosbench", "Copy.java")
    pom = os.path.join(KSTREAMS_DIR, "pom.xml")
    if (not os.path.exists(jar) or os.path.getmtime(jar) < max(os.path.getmtime(src), os.path.getmtime(pom))
            or not os.path.isdir(os.path.join(KSTREAMS_DIR, "target", "lib"))):
        log("build: mvn -q package (bench/kstreams)")
        subprocess.run(["mvn", "-q", "-B", "-f", pom, "package"], check=True)
    subprocess.run([KAFKA_SCRIPT, "fetch"], check=True, stdout=subprocess.DEVNULL)
    return built


def provenance(binary=BRIDGE_BIN):
    """Which build a run measured: the binary's hash and time, the commit, and whether it can be
    that commit's build. With --skip-build a binary left from an experiment looks like any other
    (session 22 measured a probe build as the committed one that way); a source file newer than
    the binary (a `git checkout` of a reverted probe makes one) or an uncommitted source change is
    named in `stale`."""
    st = os.stat(binary)
    h = hashlib.sha256()
    with open(binary, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    inputs = [os.path.join(ROOT, n) for n in ("Cargo.toml", "Cargo.lock", "build.rs")]
    for d, _, files in os.walk(os.path.join(ROOT, "src")):
        inputs += [os.path.join(d, n) for n in files if n.endswith(".rs")]
    newer = sorted(os.path.relpath(f, ROOT) for f in inputs
                   if os.path.exists(f) and os.path.getmtime(f) > st.st_mtime)
    stale = [f"{f} is newer than the binary" for f in newer[:5]]
    # An example is a copier of its own: its source against its own binary, not the bridge's.
    for n in sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".rs")):
        src, exe = os.path.join(ROOT, "examples", n), example(n[:-3])
        if os.path.exists(exe) and os.path.getmtime(src) > os.path.getmtime(exe):
            stale.append(f"examples/{n} is newer than its binary")
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "src", "examples", "Cargo.toml", "Cargo.lock").splitlines()
    stale += [f"uncommitted: {l.strip()}" for l in dirty[:5]]
    built = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
    return {"binary": os.path.relpath(binary, ROOT), "sha256": h.hexdigest()[:16],
            "built": built.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": git("rev-parse", "--short", "HEAD"), "stale": stale}


def provenance_line(p):
    line = f"bridge binary {p['binary']} sha256 {p['sha256']} built {p['built']}, HEAD {p['commit']}"
    if p["stale"]:
        line += "; NOT NECESSARILY HEAD'S BUILD: " + "; ".join(p["stale"])
    return line


def kafka_lib():
    out = subprocess.run([KAFKA_SCRIPT, "fetch"], check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# Broker


def mem_available_mb():
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] // 1024


def hold_memory(keep_free_mb):
    """The held process's body: writes every page of a buffer of all available memory but
    `keep_free_mb`, says HOLD, and keeps it until killed or until the run that started it is
    gone (a SIGKILLed bench/run must not leave most of the machine's memory held)."""
    import mmap
    parent = os.getppid()
    n = max(0, mem_available_mb() - keep_free_mb) << 20
    t = time.time()
    if n:
        buf = mmap.mmap(-1, n)
        chunk = memoryview(b"\1" * (64 << 20))
        for off in range(0, n, len(chunk)):
            part = chunk[:min(len(chunk), n - off)]
            buf[off:off + len(part)] = part
    print(f"HOLD {n >> 20} {time.time() - t:.1f}", flush=True)
    while os.getppid() == parent:
        time.sleep(1)


class MemoryHold:
    """Holds all available memory but `keep_free_mb` for a run, written, so that the broker's
    appends recycle page cache instead of taking fresh pages.

    Why (bench/README.md, "Session 25"): on the 2-core VM the guest hands free pages back to the
    host (DAMON pageout of cold page cache, virtio-balloon free page reporting), and a page the
    host must supply again costs ~30 µs to first touch (this hold writes ~140 MB/s). A drain whose
    output lands on such pages had the broker spend 52-60 % of its CPU in
    copy_folio_from_iter_atomic and memset, 2-4x the broker CPU per record of a drain that
    recycled cache, for whichever copier happened to run then. With little memory free the
    kernel reclaims cache for new writes at once, and no page stays free long enough to go back."""

    def __init__(self, keep_free_mb, workdir):
        self.keep_free_mb = keep_free_mb
        self.workdir = workdir
        self.proc = None
        self.held_mb = 0
        self.seconds = 0.0

    def start(self):
        if not self.keep_free_mb:
            return self
        self.proc = Proc([sys.executable, os.path.abspath(__file__), "hold-memory", str(self.keep_free_mb)],
                         os.path.join(self.workdir, "hold-memory.log"))
        line = self.proc.wait_line("HOLD", 900)
        if line is None:
            self.proc.stop(5)
            raise RuntimeError(f"the memory hold did not start; see {self.workdir}/hold-memory.log")
        _, mb, secs = line.split()
        self.held_mb, self.seconds = int(mb), float(secs)
        log(f"holding {self.held_mb} MB of memory (written in {self.seconds:.0f}s), {self.keep_free_mb} MB left free")
        return self

    def meta(self):
        return {"keep_free_mb": self.keep_free_mb, "held_mb": self.held_mb, "seconds": self.seconds}

    def stop(self):
        if self.proc:
            self.proc.stop(5)
            self.proc = None


class Broker:
    def __init__(self, name):
        self.name = name
        self.bootstrap = None
        self.pid = None
        # scripts/kafka keeps each named broker's run dir here; its log.dirs is `data` inside.
        self.run_dir = os.path.join(KAFKA_CACHE, "run", name)
        self.data_dir = os.path.join(self.run_dir, "data")

    def start(self, heap=None, java_opts=None):
        env = dict(os.environ)
        if heap:
            env["EOS_BRIDGE_KAFKA_HEAP"] = heap
        if java_opts:
            env["EOS_BRIDGE_KAFKA_OPTS"] = java_opts
        out = subprocess.run([KAFKA_SCRIPT, "start", "--name", self.name, "--fresh"], check=True,
                             capture_output=True, text=True, env=env).stdout
        self.bootstrap = out.strip().splitlines()[-1]
        with open(os.path.join(self.run_dir, "pid")) as f:
            self.pid = int(f.read().strip())
        log(f"broker '{self.name}' up at {self.bootstrap} (pid {self.pid})")
        return self

    def stop(self):
        subprocess.run([KAFKA_SCRIPT, "stop", "--name", self.name, "--purge"], check=False)


# ---------------------------------------------------------------------------------------------
# Helper programs (cargo examples)


def example(name):
    return os.path.join(EXAMPLES, name)


def probe(*args, check=True):
    r = subprocess.run([example("bench_probe"), *map(str, args)], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"bench_probe {' '.join(map(str, args))} failed: {r.stderr.strip()}")
    return r.stdout.strip()


def settle_disk():
    """Writes every dirty page out now and returns the seconds it took. The kernel holds written
    data for up to 30 s (vm.dirty_expire_centisecs) and then writes it in bursts (here ~2.3 GB in
    under 5 s after a 3 GB write): a prefill or the previous run's 1 KB drain would otherwise be
    written out in the middle of the next measurement, beside the broker's appends."""
    t = time.time()
    os.sync()
    return time.time() - t


def create_topics(bootstrap, partitions, *topics):
    probe("create", "--bootstrap", bootstrap, "--partitions", partitions, *topics)


def delete_topics(bootstrap, *topics):
    probe("delete", "--bootstrap", bootstrap, *topics, check=False)


def end_offsets(bootstrap, topic):
    return int(probe("end", "--bootstrap", bootstrap, topic))


def count_committed(bootstrap, topic):
    return int(probe("count", "--bootstrap", bootstrap, topic))


def kafka_tool(cls, *args):
    """The stdout of a Kafka command-line class run through scripts/kafka tool (its class path, a
    short-lived JVM); a failure raises."""
    return subprocess.run([KAFKA_SCRIPT, "tool", cls, *args], check=True, capture_output=True,
                          text=True).stdout


BATCH_LINE = re.compile(r"baseOffset: \d+ lastOffset: \d+ count: (\d+) .*isTransactional: (\w+) "
                        r"isControl: (\w+) .*size: (\d+)")


def log_batches(data_dir, topic):
    """What a topic's log holds, batch by batch, read from the broker's segment files with Kafka's
    own DumpLogSegments: the data batches, their records and bytes (as stored, compressed), and the
    control batches (transaction markers). How a producer batched is what the broker paid for per
    record; no client statistic of ours or the floor's is needed to compare them."""
    files = sorted(os.path.join(data_dir, d, f) for d in os.listdir(data_dir)
                   if d.rpartition("-")[0] == topic
                   for f in os.listdir(os.path.join(data_dir, d)) if f.endswith(".log"))
    if not files:
        raise RuntimeError(f"no log segments of topic {topic} under {data_dir}")
    out = kafka_tool("kafka.tools.DumpLogSegments", "--files", ",".join(files))
    data = {"batches": 0, "records": 0, "bytes": 0, "control": 0}
    for m in BATCH_LINE.finditer(out):
        if m.group(3) == "true":
            data["control"] += 1
        else:
            data["batches"] += 1
            data["records"] += int(m.group(1))
            data["bytes"] += int(m.group(4))
    return data


def jmx_opts(port):
    """The broker's JVM options for remote JMX on 127.0.0.1:`port`, no auth (a benchmark broker on
    the loopback only), for `broker_requests`; `Broker.start(java_opts=...)` adds them to its heap."""
    return (f"-Dcom.sun.management.jmxremote -Dcom.sun.management.jmxremote.port={port} "
            f"-Dcom.sun.management.jmxremote.rmi.port={port} -Dcom.sun.management.jmxremote.authenticate=false "
            f"-Dcom.sun.management.jmxremote.ssl=false -Djava.rmi.server.hostname=127.0.0.1")


REQUEST_COUNT = re.compile(r"RequestMetrics,name=RequestsPerSec,request=(\w+),version=\d+:Count=([0-9.E]+)")


def broker_requests(port):
    """Requests the broker has handled since it started, by type (Kafka's RequestMetrics
    `RequestsPerSec` counts, all versions summed), read over JMX with Kafka's JmxTool."""
    out = kafka_tool("org.apache.kafka.tools.JmxTool", "--jmx-url",
                     f"service:jmx:rmi:///jndi/rmi://127.0.0.1:{port}/jmxrmi", "--object-name",
                     "kafka.network:type=RequestMetrics,name=RequestsPerSec,request=*,version=*",
                     "--attributes", "Count", "--one-time", "true", "--report-format", "properties")
    counts = {}
    for m in REQUEST_COUNT.finditer(out):
        counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
    return counts


def java_tool(lib, cls, args, log_path):
    """Runs a Kafka CLI class with full JIT (scripts/kafka tool limits the JIT to start fast).
    Returns (stdout, cpu seconds, peak RSS MB, wall seconds) of the JVM."""
    cmd = ["java", "-Xms64m", "-Xmx512m", "-XX:+UseG1GC",
           f"-Dlog4j2.configurationFile={ROOT}/scripts/kafka-deps/log4j2.properties",
           "-Deos.kafka.loglevel=WARN", "-cp", os.path.join(lib, "*"), cls, *map(str, args)]
    t0 = time.time()
    with open(log_path, "ab") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        out = p.stdout.read().decode()
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{cls} failed (exit {p.returncode}); see {log_path}")
    return out, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024.0, wall


# ---------------------------------------------------------------------------------------------
# Processes with line-oriented stdout


class Proc:
    """A child process whose stdout lines are collected (with their arrival time) by a thread."""

    def __init__(self, cmd, log_path, env=None, cwd=None):
        self.cmd = cmd
        self.errf = open(log_path, "ab")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.errf, env=env, cwd=cwd,
                                  start_new_session=True)
        self.pid = self.p.pid
        self.lines = []  # (arrival ms, line)
        self.cond = threading.Condition()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        for raw in self.p.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self.cond:
                self.lines.append((now_ms(), line))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_line(self, prefix, timeout):
        end = time.time() + timeout
        seen = 0
        with self.cond:
            while True:
                for _, line in self.lines[seen:]:
                    if line.startswith(prefix):
                        return line
                seen = len(self.lines)
                left = end - time.time()
                if left <= 0 or (self.p.poll() is not None and not self._t.is_alive()):
                    for _, line in self.lines[seen:]:
                        if line.startswith(prefix):
                            return line
                    return None
                self.cond.wait(min(left, 0.5))

    def alive(self):
        return self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout=30):
        self.signal(signal.SIGTERM)
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.p.wait()
        self._t.join(5)
        self.errf.close()

    def kill9(self):
        self.signal(signal.SIGKILL)
        self.p.wait()
        self._t.join(5)
        self.errf.close()


# ---------------------------------------------------------------------------------------------
# eos-bridge


def bridge_config(path, *, bootstrap, bridge_id, state_dir, topic_in, topic_out, interval, delivery,
                  port):
    with open(path, "w") as f:
        f.write(f"""# Written by bench/: one benchmark run.
[bridge]
id = "{bridge_id}"
state_dir = "{state_dir}"
delivery = "{delivery}"

[source]
bootstrap_servers = "{bootstrap}"
topics = ["{topic_in}"]
start = "earliest"

[sink]
topic = "{topic_out}"

[checkpoint]
interval = "{interval}"

[transaction]
timeout = "60s"

[api]
listen = "127.0.0.1:{port}"
""")
        # The copiers' statistics window (examples/common), so that the bridge's sink round trips
        # are logged (eos_bridge::sink=debug) over the same window as theirs.
        stats_ms = os.environ.get("BENCH_PRODUCER_STATS_MS")
        if stats_ms:
            f.write(f'\n[sink.kafka]\n"statistics.interval.ms" = "{int(stats_ms)}"\n')


def http_json(url, timeout=1.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def http_text(url, timeout=1.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Bridge:
    def __init__(self, workdir, *, bootstrap, topic_in, topic_out, interval, delivery, bridge_id=None,
                 state_dir=None, binary=None):
        """binary: another eos-bridge build (bench/run's c2x_ phases: an A/B in one run)."""
        self.binary = binary or BRIDGE_BIN
        self.port = free_port()
        self.id = bridge_id or f"bench-{rand_suffix()}"
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="state-", dir=workdir)
        self.config = os.path.join(workdir, f"{self.id}.toml")
        self.log = os.path.join(workdir, f"{self.id}.log")
        bridge_config(self.config, bootstrap=bootstrap, bridge_id=self.id, state_dir=self.state_dir,
                      topic_in=topic_in, topic_out=topic_out, interval=interval, delivery=delivery,
                      port=self.port)
        self.proc = None

    def start(self, wrap=()):
        """wrap: a command the bridge runs under (a profiler that becomes the bridge's process)."""
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        self.proc = Proc([*wrap, self.binary, "run", "--config", self.config], self.log, env=env)
        # A comparison of builds is only as good as knowing which one ran (bench/README.md,
        # "Session 26"); under a wrapper the process is the wrapper's.
        running = os.path.realpath(f"/proc/{self.pid}/exe")
        if not wrap and running != os.path.realpath(self.binary):
            self.proc.kill9()
            raise RuntimeError(f"bridge {self.id} runs {running}, not {self.binary}")
        return self

    @property
    def pid(self):
        return self.proc.pid

    def status(self):
        return http_json(f"http://127.0.0.1:{self.port}/api/v1/status", timeout=2.0)

    def metrics(self):
        return http_text(f"http://127.0.0.1:{self.port}/metrics", timeout=2.0)

    def wait_running(self, timeout=90, poll=0.02):
        end = time.time() + timeout
        while time.time() < end:
            if not self.proc.alive():
                raise RuntimeError(f"eos-bridge exited during start-up; see {self.log}")
            try:
                st = self.status()
                if st.get("state") == "running" and st.get("partitions_assigned"):
                    return st
                if st.get("state") == "failed":
                    raise RuntimeError(f"eos-bridge failed: {st.get('failure')}; see {self.log}")
            except (OSError, ValueError):
                pass
            time.sleep(poll)
        raise RuntimeError(f"eos-bridge not running after {timeout}s; see {self.log}")


def positions_sum(st):
    return sum(p["position"] for p in st.get("partitions", []))


# ---------------------------------------------------------------------------------------------
# Statistics


def steady_rate(events, n):
    """Records per second between the first progress observation at >= 10% of the input and the
    last one before the end: whole checkpoints only, without start-up or the final partial one.
    events: (ms, records done) at each change. A copier whose progress moves only at its commits
    (the bridge's positions, txn_copy's `P` lines) reaches the end at the first barrier after its
    last record, up to an interval later; measured to the end, a 1 s copier of a 4 s drain would
    lose up to a quarter of its rate against one that counts its acks as they come (raw_copy)."""
    first = next((e for e in events if e[1] >= 0.1 * n), None)
    before_end = [e for e in events if e[1] < n]
    done = next((e for e in events if e[1] >= n), None)
    last = before_end[-1] if before_end else None
    if first and last and last[1] >= 0.5 * n and last[0] > first[0] and last[1] > first[1]:
        a, b = first, last
    elif first and done and done[0] > first[0]:
        a, b = first, done
    else:
        return None, None
    return (b[1] - a[1]) / ((b[0] - a[0]) / 1000.0), [a, b]


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2.0


def spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return [min(xs), max(xs)]


def by_label(lines, name, label):
    """{value of `label`: sample} of the series `name{...}` in /metrics lines (samples sharing a
    value summed); {} when the lines hold none."""
    out = {}
    prefix, needle = name + "{", label + '="'
    for line in lines or []:
        if line.startswith(prefix) and needle in line:
            key = line.split(needle, 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(None, 1)[1])
    return out


def histogram(lines, name):
    """The cumulative buckets {upper bound: count} of a Prometheus histogram without labels other
    than `le`, from /metrics lines; {} when the lines hold none."""
    return {float(le): n for le, n in by_label(lines, name + "_bucket", "le").items()}


def merge_histograms(hs):
    """Bucket-wise sum of histograms taken from separate processes (same bucket bounds)."""
    out = {}
    for h in hs:
        for le, c in h.items():
            out[le] = out.get(le, 0.0) + c
    return out


def histogram_quantile(buckets, q):
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q, the
    largest finite bound when that is the +Inf bucket. None without observations."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in items:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


if __name__ == "__main__" and sys.argv[1:2] == ["hold-memory"]:
    hold_memory(int(sys.argv[2]))
