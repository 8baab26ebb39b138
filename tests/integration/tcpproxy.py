"""A TCP proxy for tests that alter or cut what passes between a client and a daemon
(test_bulk_tcp, test_cluster_bulk): 127.0.0.2:port forwarded to 127.0.0.1:port."""
import socket
import threading


class Proxy:
    """TCP from 127.0.0.2:port to 127.0.0.1:port. Bytes from the daemon pass through
    mutate(offset, data) (offset: of data in the connection's stream), which returns the
    bytes to pass on, or None to cut the connection there. The first bytes each client
    sends on a connection are kept in self.first (a bulk connection's hello)."""

    def __init__(self, port, mutate=None, mutate_up=None):
        self.port, self.mutate, self.first = port, mutate, []
        self.mutate_up = mutate_up  # the same for bytes from the client
        self.ls = socket.create_server(("127.0.0.2", port))
        self.stop = False
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while not self.stop:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self.pump, args=(c, s, self.mutate_up, True),
                             daemon=True).start()
            threading.Thread(target=self.pump, args=(s, c, self.mutate, False),
                             daemon=True).start()

    def pump(self, src, dst, mutate, keep_first):
        off = 0
        try:
            while True:
                b = src.recv(1 << 16)
                if not b:
                    break
                if keep_first and off == 0:
                    self.first.append(b)
                if mutate:
                    b2 = mutate(off, b)
                    if b2 is None:
                        break
                    off += len(b)
                    b = b2
                else:
                    off += len(b)
                dst.sendall(b)
        except OSError:
            pass
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            x.close()

    def close(self):
        self.stop = True
        try:
            self.ls.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass
        self.ls.close()
