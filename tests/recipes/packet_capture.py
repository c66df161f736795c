"""Capture the TCP payloads crossing one network interface (root, an AF_PACKET socket): run as
`python -m tests.recipes.packet_capture IFACE OUT_DIR STOP_FILE`, it appends each TCP stream's payload
bytes (keyed by its endpoints) to OUT_DIR/<src>_<sport>-<dst>_<dport>.bin until STOP_FILE exists.
Retransmitted segments may repeat bytes; nothing here depends on exact order."""

import socket
import struct
import sys
from pathlib import Path

ETH_P_ALL = 0x0003
IPV4 = 0x0800
TCP = 6
PER_STREAM_LIMIT = 8 << 20  # bytes kept per stream (the greeting and what follows is what is checked)


def main() -> None:
    interface, out, stop = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
    sock.bind((interface, 0))
    sock.settimeout(0.2)
    kept: dict[str, int] = {}
    (out / "ready").touch()
    while not stop.exists():
        try:
            frame = sock.recv(65535)  # both directions: what this side sends and what it receives
        except TimeoutError:
            continue
        if len(frame) < 34 or struct.unpack("!H", frame[12:14])[0] != IPV4:
            continue
        ip = frame[14:]
        header = (ip[0] & 0x0F) * 4
        if ip[9] != TCP:
            continue
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[header:total]
        sport, dport = struct.unpack("!HH", tcp[:4])
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if not payload:
            continue
        name = f"{socket.inet_ntoa(ip[12:16])}_{sport}-{socket.inet_ntoa(ip[16:20])}_{dport}"
        if kept.get(name, 0) < PER_STREAM_LIMIT:
            with open(out / f"{name}.bin", "ab") as f:
                f.write(payload)
        kept[name] = kept.get(name, 0) + len(payload)
    (out / "totals.txt").write_text("".join(f"{name} {n}\n" for name, n in sorted(kept.items())))


if __name__ == "__main__":
    main()
