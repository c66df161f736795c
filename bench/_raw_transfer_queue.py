"""Raw TransferQueue servers for the baseline: its own controller and one storage unit, as plain processes
(its documented no-Ray pattern), bound to loopback. Prints their server infos as one JSON line, then
serves until stdin closes."""

import json
import os
import sys


def _serve(make, conn) -> None:
    server = make()
    info = server.get_zmq_server_info()
    conn.send({"role": str(info.role.value), "id": info.id, "ip": info.ip, "ports": dict(info.ports)})
    conn.close()
    while True:
        os.read(0, 1) or os._exit(0)


def main() -> None:
    import multiprocessing as mp

    import transfer_queue.controller as tq_controller
    import transfer_queue.storage.simple_storage as tq_storage

    for module in (tq_controller, tq_storage):
        module.get_node_ip_address = lambda: "127.0.0.1"
    makers = {
        "storage": lambda: tq_storage.SimpleStorageUnit.__ray_actor_class__({}),
        "controller": lambda: tq_controller.TransferQueueController.__ray_actor_class__(polling_mode=True),
    }
    ctx = mp.get_context("fork")
    infos = {}
    for name, make in makers.items():
        parent, child = ctx.Pipe()
        ctx.Process(target=_serve, args=(make, child), daemon=True).start()
        infos[name] = parent.recv()
    print(json.dumps(infos), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
