"""A process job's network: a namespace of its own with a private loopback, and outbound traffic
through slirp4netns; and the launcher step that makes it (with the job's Landlock scopes).

Process jobs used to share the node's network namespace: any job could connect to another
tenant's job's listener on 127.0.0.1 (an unauthenticated Jupyter, TensorBoard or debug port) and
to the pool's own loopback services. A job now gets a network namespace of its own: its loopback
is its own, and its traffic out goes through slirp4netns (user-mode TCP/IP in a root process on
the node's network, `--disable-host-loopback`: nothing reaches the node's 127.0.0.1). The job sees
`tap0` (10.0.2.100/24, gateway 10.0.2.2, DNS 10.0.2.3, MTU 65520); nobody can connect in. Its
routes refuse the cloud's instance metadata addresses (`METADATA_NETS`: 169.254.0.0/16, …), which
hand whoever asks the node's own cloud credentials; the job cannot change its routes (no
capabilities), and a connection there fails at once with EACCES.

Jobs that must be reached on the node's network keep it (`needs_host_network`): those the pool
gave ports to listen on (a service replica, a cooperative RPC server, a gang's rank 0), every gang
member (its ranks dial each other), and a function's worker whose control plane listens on the
node's loopback (it calls it back; a worker of a control plane elsewhere reaches it through
slirp4netns like any other host, and keeps its own network: a function's command is the tenant's
own). They still get the Landlock scopes (landlock.py).

The launcher (`python -I -m computepool.agent.jobnet [--own-network SLIRP [--slirp-group GID]]
[--scope] -- ARGV`, or
the same options given to the syscall filter's loader, which then does both in one process) runs
as root, first in the job's chain: it moves itself into a new network namespace, brings its
loopback up, starts slirp4netns for it (from the node's namespace, in a session of its own, so
the job's stop signal leaves the network up for its grace period; killed by the kernel when the
launcher's process, by then the job's `unshare`, ends) and waits until it is configured (about
10 ms), and execs ARGV. The Landlock scopes come first: slirp4netns is in the job's domain (a
signal from inside a scoped domain reaches nothing outside it, the kernel's end-with-the-parent
signal included). Where the node's resolv.conf names a resolver on its loopback (systemd-resolved's
127.0.0.53), the job's names slirp4netns's DNS address instead (a copy bound over it in a mount
namespace of the launcher's), which forwards there. Where slirp4netns fails the job still runs,
with its private loopback alone, and its stderr says why.

Only the standard library: this runs ahead of everything else in the job's launcher.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import select
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
RESOLV = "/etc/resolv.conf"
RESOLV_COPY = "/run/computepool/job-resolv.conf"  # root's; bound over a job's /etc/resolv.conf
SLIRP_DNS = "10.0.2.3"
PR_SET_PDEATHSIG = 1
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
RTM_NEWROUTE, NLMSG_ERROR, RTA_DST = 24, 2, 1
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
RT_TABLE_MAIN, RTPROT_STATIC, RTN_PROHIBIT = 254, 4, 8
MTU = 65520
# where clouds answer a node's machine with its credentials: link-local (AWS, GCP, Azure, OpenStack,
# ECS task roles at 169.254.170.2) and Alibaba's 100.100.100.200; a job's routes refuse them
METADATA_NETS = ("169.254.0.0/16", "100.100.100.200/32")
TAP = "tap0"
# slirp4netns runs as root (it enters the job's namespace) in its tenant's group (`--slirp-group`,
# the tenant user's gid), else in this group of its own, which no user has: the host firewall
# (hostwall.py) tells its connections apart by root's uid in such a group and keeps them off the
# tenants' container networks, whose bridges are the node's own (a job reached any port of another
# tenant's container at its bridge address through slirp4netns, as root); by the group it also
# counts each tenant's slirp4netns flows in the node's one connection table (one group for every
# tenant's left them uncounted: a plain job filled the table through its slirp4netns)
SLIRP_GID = 2147483547
# the line a launcher step that cannot isolate the job writes on its stderr before exit 126
SANDBOX_FAILED = "cpool: the node could not set up the job's sandbox"
READY_TIMEOUT_S = 10.0
SUMMARY = "own network namespace (private loopback; outbound through slirp4netns, not to the node's loopback)"
_WORKER_ENV = "CPOOL_WORKER_TOKEN"  # a function's worker (CPOOL_ names are the pool's alone)


def needs_host_network(
    given_ports: Sequence[object], gang: bool, env: Mapping[str, str], private_network: bool
) -> bool:
    """Whether a process job keeps the node's network: the pool gave it ports to listen on, it is
    a gang member or a function's worker, or it makes its own network (a cooperative RPC server).
    Nothing a request sets decides it: requests may not name CPOOL_ variables nor give a process
    job ports."""
    worker = _WORKER_ENV in env and on_loopback(env.get("CPOOL_SERVER", ""))
    return any(given_ports) or gang or worker or private_network


def on_loopback(url: str) -> bool:
    """Whether the control plane at `url` is reached on the node's loopback (its name resolves to a
    loopback address, as a host name mapped to 127.0.1.1 does), or cannot be told."""
    from urllib.parse import urlsplit  # noqa: PLC0415 - the agent's alone, never a job's launcher

    try:
        host = urlsplit(url).hostname or ""
        addresses = [ipaddress.ip_address(host)] if _literal(host) else [
            ipaddress.ip_address(str(a[4][0]).split("%")[0]) for a in socket.getaddrinfo(host, None)
        ]  # fmt: skip
    except (OSError, ValueError, UnicodeError):
        return True
    return not addresses or any(a.is_loopback for a in addresses)


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def slirp_argv(slirp: str, pid: int, ready_fd: int) -> list[str]:
    return [
        slirp, "--configure", f"--mtu={MTU}", "--disable-host-loopback", "--enable-sandbox",
        "--enable-seccomp", f"--ready-fd={ready_fd}", str(pid), TAP,
    ]  # fmt: skip


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def loopback_up() -> None:
    """Bring `lo` up in this process's network namespace (a new one starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def refuse_route(net: str) -> None:
    """A `prohibit` route to `net` in this network namespace (rtnetlink, as `ip route add prohibit
    NET`): connecting there fails with EACCES. Raises OSError."""
    dst = ipaddress.ip_network(net)
    family = socket.AF_INET if dst.version == 4 else socket.AF_INET6
    attr = struct.pack("HH", 4 + len(dst.network_address.packed), RTA_DST) + dst.network_address.packed
    attr += b"\0" * (-len(attr) % 4)
    # rtmsg: family, dst_len, src_len, tos, table, protocol, scope (universe), type, flags
    rtm = struct.pack(
        "BBBBBBBBI", family, dst.prefixlen, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, 0, RTN_PROHIBIT, 0
    )
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    msg = struct.pack("IHHII", 16 + len(rtm) + len(attr), RTM_NEWROUTE, flags, 1, 0) + rtm + attr
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
        nl.sendto(msg, (0, 0))
        answer = nl.recv(4096)
    kind = struct.unpack_from("H", answer, 4)[0]
    err = -struct.unpack_from("i", answer, 16)[0] if kind == NLMSG_ERROR else 0
    if err:
        raise OSError(err, f"route prohibit {net}: {os.strerror(err)}")


def own_network(slirp: str | None, group: int | None = None) -> str:
    """Move this process into a new network namespace with its loopback up, and give it outbound
    traffic through `slirp` (None: loopback alone), run in `group` (None: SLIRP_GID). Returns "" or
    why there is no outbound.
    Raises OSError when the namespace itself cannot be made."""
    libc = _libc()
    host_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        loopback_up()
        for net in METADATA_NETS:
            refuse_route(net)
        if slirp is None:
            return "slirp4netns is not installed: no outbound network"
        why = _start_slirp(slirp, host_ns, SLIRP_GID if group is None else group)
    finally:
        os.close(host_ns)
    if not why:
        try:
            text = Path(RESOLV).read_text()
        except OSError:
            return ""
        mine = job_resolv(text)
        if mine is not None:
            _bind_resolv(mine)
    return why


def job_resolv(text: str) -> str | None:
    """The job's resolv.conf where the node's names a resolver on its loopback (systemd-resolved's
    127.0.0.53, a local dnsmasq), which the job's own loopback lacks: slirp4netns's DNS address
    instead, which forwards there (its gateway never does). None: the node's serves as it is."""
    out, looped = [], False
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 2 and f[0] == "nameserver" and _loopback(f[1]):
            out += [] if looped else [f"nameserver {SLIRP_DNS}"]
            looped = True
        else:
            out.append(line)
    return "\n".join(out) + "\n" if looped else None


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _bind_resolv(text: str) -> None:
    """`text` over /etc/resolv.conf, for this process and what it runs alone (a mount namespace of
    its own; slirp4netns, started before, keeps reading the node's). Raises OSError."""
    os.makedirs(os.path.dirname(RESOLV_COPY), mode=0o755, exist_ok=True)
    tmp = f"{RESOLV_COPY}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, RESOLV_COPY)  # a job's mount holds the file it bound, whatever replaces it
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    target = os.path.realpath(RESOLV).encode()
    _check(libc.mount(RESOLV_COPY.encode(), target, None, MS_BIND, None), f"mount --bind over {RESOLV}")


def _start_slirp(slirp: str, host_ns: int, group: int) -> str:
    me = os.getpid()
    ready_r, ready_w = os.pipe()

    def in_host_network() -> None:  # in the child, before exec (host_ns is still open there)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(host_ns, CLONE_NEWNET) != 0:
            os._exit(120)
        # slirp4netns's sandbox detaches the old root after pivot_root; where the node's mounts are
        # shared (/run/netns is, for `ip netns` and podman), that unmount would reach the node's
        # own namespace and unmount every named network namespace there. A private copy first.
        if libc.unshare(CLONE_NEWNS) != 0 or libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            os._exit(122)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # gone with the job's launcher
        if os.getppid() != me:  # the launcher died before the line above
            os._exit(121)

    try:
        proc = subprocess.Popen(
            slirp_argv(slirp, me, ready_w), pass_fds=(ready_w,), preexec_fn=in_host_network,
            group=group, extra_groups=[], start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
        )  # fmt: skip
    except OSError as e:
        os.close(ready_r)
        return f"slirp4netns could not start: {e.strerror or e}"
    finally:
        os.close(ready_w)
    try:
        readable, _, _ = select.select([ready_r], [], [], READY_TIMEOUT_S)
        got = os.read(ready_r, 1) if readable else b""
    finally:
        os.close(ready_r)
    if got == b"1":
        return ""
    if readable:
        rc = proc.wait()
        return f"slirp4netns exited {rc} before the network was up"
    proc.kill()
    return f"slirp4netns did not bring the network up within {READY_TIMEOUT_S:g} s"


def prepare(slirp: str | None, own: bool, scope: bool, group: int | None = None) -> None:
    """What the launcher does before it execs the job's next step; raises OSError (the job must
    not run without what it was promised: its own network namespace, its scopes)."""
    if scope:  # first: slirp4netns shares the job's domain, where the kernel's signal that ends
        # it with the job (PR_SET_PDEATHSIG, sent as from the dying launcher) may reach it
        from computepool.agent import landlock  # noqa: PLC0415 - only the launchers that scope need it

        landlock.restrict_scopes()
    if own:
        why = own_network(slirp, group)
        if why:
            print(f"cpool: the job has no outbound network: {why}", file=sys.stderr, flush=True)


def parse(argv: Sequence[str]) -> tuple[str | None, bool, bool, int | None, list[str]] | None:
    """[--own-network SLIRP|- [--slirp-group GID]] [--scope] -- ARGV → (slirp, own, scope, group,
    ARGV); None when malformed."""
    slirp, own, scope, group, i = None, False, False, None, 0
    while i < len(argv) and argv[i] != "--":
        if argv[i] == "--own-network" and i + 1 < len(argv):
            own, slirp = True, (None if argv[i + 1] == "-" else argv[i + 1])
            i += 2
        elif argv[i] == "--slirp-group" and i + 1 < len(argv) and argv[i + 1].isdigit():
            group, i = int(argv[i + 1]), i + 2
        elif argv[i] == "--scope":
            scope, i = True, i + 1
        else:
            return None
    rest = list(argv[i + 1 :])
    return (slirp, own, scope, group, rest) if i < len(argv) and rest else None


def options(own_network_with: str | None, own: bool, scope: bool, group: int | None = None) -> list[str]:
    """The launcher's options (`parse`'s inverse); `group`: slirp4netns's (the tenant's gid)."""
    out = ["--own-network", own_network_with or "-"] if own else []
    out += ["--slirp-group", str(group)] if own and group is not None else []
    return [*out, "--scope"] if scope else out


def launcher_argv(opts: Sequence[str], python: str = sys.executable) -> list[str]:
    """What goes before ARGV to run it in its own network and scopes (no syscall filter here)."""
    from computepool.agent.pystart import module_argv  # the agent's side: the launcher needs none of it

    return [*module_argv("computepool.agent.jobnet", python), *opts, "--"]


def main(argv: Sequence[str]) -> int:
    parsed = parse(argv)
    if parsed is None:
        print(
            "usage: python -I -m computepool.agent.jobnet [--own-network SLIRP|- [--slirp-group GID]] "
            "[--scope] -- "
            "COMMAND [ARG...]",
            file=sys.stderr,
        )
        return 2
    slirp, own, scope, group, rest = parsed
    try:
        prepare(slirp, own, scope, group)
    except OSError as e:
        print(f"{SANDBOX_FAILED}: a network of its own: {e}", file=sys.stderr)
        return 126
    try:
        os.execvp(rest[0], rest)
    except OSError as e:
        print(f"cpool: cannot run {rest[0]}: {e.strerror or e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
