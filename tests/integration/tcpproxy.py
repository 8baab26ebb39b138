"""A TCP proxy for tests that alter, cut or stall what passes between a client and a
daemon (test_bulk_tcp, test_cluster_bulk, test_cluster_stall): 127.0.0.2:port forwarded
to 127.0.0.1:port."""
import socket
import threading


class Proxy:
    """TCP from 127.0.0.2:port to 127.0.0.1:port. Bytes from the daemon pass through
    mutate(offset, data) (offset: of data in the connection's stream), which returns the
    bytes to pass on, or None to cut the connection there. The first bytes each client
    sends on a connection are kept in self.first (a bulk connection's hello). stall()
    holds one direction's bytes, as a peer that answers and then sends nothing more."""

    def __init__(self, port, mutate=None, mutate_up=None):
        self.port, self.mutate, self.first = port, mutate, []
        self.mutate_up = mutate_up  # the same for bytes from the client
        self.flowing = {"up": threading.Event(), "down": threading.Event()}
        for e in self.flowing.values():
            e.set()
        self.after = {"up": 0, "down": 0}
        self.ls = socket.create_server(("127.0.0.2", port))
        self.stop = False
        threading.Thread(target=self.accept, daemon=True).start()

    def stall(self, way, on=True, after=0):
        """From now on hold (neither forward nor drop) the bytes going way ("down": from
        the daemon, "up": to it) past the first `after` bytes of each connection (a bulk
        connection's 1-byte answer to its hello passes with after=1), until
        stall(way, False) lets them go on or the connection ends (either end closing
        it)."""
        self.after[way] = after
        if on:
            self.flowing[way].clear()
        else:
            self.flowing[way].set()

    def accept(self):
        while not self.stop:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.port))
            ended = threading.Event()  # one pump ended: the connection is over
            threading.Thread(target=self.pump, args=(c, s, self.mutate_up, "up", ended),
                             daemon=True).start()
            threading.Thread(target=self.pump, args=(s, c, self.mutate, "down", ended),
                             daemon=True).start()

    def pump(self, src, dst, mutate, way, ended):
        off = 0
        try:
            while True:
                b = src.recv(1 << 16)
                if not b:
                    break
                if way == "up" and off == 0:
                    self.first.append(b)
                at = off
                if mutate:
                    b2 = mutate(off, b)
                    if b2 is None:
                        break
                    off += len(b)
                    b = b2
                else:
                    off += len(b)
                if not self.flowing[way].is_set():
                    free = max(0, min(len(b), self.after[way] - at))
                    if free:
                        dst.sendall(b[:free])
                        b = b[free:]
                    while b and not self.flowing[way].wait(0.02):
                        if ended.is_set():
                            raise OSError("the connection ended while stalled")
                dst.sendall(b)
        except OSError:
            pass
        ended.set()
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            x.close()

    def close(self):
        self.stop = True
        for e in self.flowing.values():
            e.set()
        try:
            self.ls.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass
        self.ls.close()
