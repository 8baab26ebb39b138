"""A cluster whose etcd speaks only TLS and wants a password (issue 20): a real etcd
(Debian's etcd-server) with a server certificate for 127.0.0.1, --client-cert-auth,
authentication enabled (root, and a user `kvblend` whose role may read and write the
cluster's prefix only) and a token TTL of 2 s; certificates made here by `openssl`.

usage: python3 -m pytest tests/integration/test_cluster_etcd_tls.py
       --kvblendd KVBLENDD --kvblend KVBLEND

Checks:
1. settings refused before any call: a TLS file with an http:// endpoint, a certificate
   without its key, a user without a password file, a password file that cannot be read
   or is empty, each with a message naming the setting.
2. settings etcd refuses stop the start, with the problem named: a CA that did not sign
   etcd's certificate, no client certificate, a wrong password, a user whose role has no
   permission on the prefix (another cluster name), no user at all.
3. two daemons form a cluster through it: a chunk PUT through one reads back byte for
   byte through the other; the password never appears on their command line.
4. tokens expire (2 s, while the lease is renewed every 3.3 s): after 12 s neither
   daemon counts an etcd error, and a third member joining is seen by both.
"""

import base64
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

import cluster_common as cc
import kvbtest


def test_cluster_etcd_tls(kvblendd, kvblend):
    TMP = tempfile.mkdtemp(prefix="kvb-tls-")
    cli = cc.MemberCli(kvblend, TMP)
    stats = cli.stats
    check = kvbtest.Checks()
    NAME = "tls"
    PORTS = {n: kvbtest.free_port() for n in ("a", "b", "c")}
    daemons = {}

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    def make_ca(stem):
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", f"{TMP}/{stem}.key", "-out", f"{TMP}/{stem}.pem", "-days", "2",
                "-subj", f"/CN=kvbtest {stem}")

    def make_cert(stem, ca, subj, ext):
        """A key and a certificate signed by ca, with the extensions ext (one a line)."""
        with open(f"{TMP}/{stem}.ext", "w") as f:
            f.write(ext)
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", f"{TMP}/{stem}.key", "-out", f"{TMP}/{stem}.csr", "-subj", subj)
        openssl("x509", "-req", "-in", f"{TMP}/{stem}.csr", "-CA", f"{TMP}/{ca}.pem", "-CAkey",
                f"{TMP}/{ca}.key", "-CAcreateserial", "-out", f"{TMP}/{stem}.pem", "-days", "2",
                "-extfile", f"{TMP}/{stem}.ext")

    make_ca("ca")
    make_ca("other-ca")
    # serverAuth and clientAuth: etcd's gateway reaches etcd's gRPC with this certificate too.
    make_cert("server", "ca", "/CN=127.0.0.1",
              "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    # etcd's JSON gateway refuses a client certificate with a Common Name: none here.
    make_cert("client", "ca", "/O=kvblend", "extendedKeyUsage=clientAuth\n")
    TLS = {"ca": f"{TMP}/ca.pem", "cert": f"{TMP}/server.pem", "key": f"{TMP}/server.key",
           "client_cert": f"{TMP}/client.pem", "client_key": f"{TMP}/client.key"}
    ETCD = kvbtest.Etcd(TMP, tls=TLS, extra=["--auth-token-ttl", "2"])
    PASSWORD = "s3cret-kvb"
    for stem, text in (("password", PASSWORD + "\n"), ("wrong-password", "not-it\n"),
                       ("empty-password", "\n")):
        with open(f"{TMP}/{stem}", "w") as f:
            f.write(text)
        os.chmod(f"{TMP}/{stem}", 0o600)

    def b64(s):
        return base64.b64encode(s.encode()).decode()

    def gateway(path, body, token=None):
        """POST body to etcd's gateway over TLS with the client certificate; the answer."""
        req = urllib.request.Request(f"{ETCD.url}{path}", data=json.dumps(body).encode())
        if token:
            req.add_header("Authorization", token)
        with urllib.request.urlopen(req, timeout=5, context=ETCD.ssl_context()) as r:
            return json.loads(r.read())

    def set_up_auth():
        """root, a role with read-write on /kvblend/tls/, user kvblend in it; auth on."""
        def leader():  # /version answers before etcd has elected itself: 503 until then
            try:
                return gateway("/v3/kv/range", {"key": b64("/")}) is not None
            except urllib.error.HTTPError:
                return False
        wait_for(leader, 20)
        gateway("/v3/auth/user/add", {"name": "root", "password": "rootpw"})
        gateway("/v3/auth/user/grant", {"user": "root", "role": "root"})
        gateway("/v3/auth/role/add", {"name": "kvb"})
        gateway("/v3/auth/role/grant", {"name": "kvb", "perm": {
            "permType": "READWRITE", "key": b64(f"/kvblend/{NAME}/"),
            "range_end": b64(f"/kvblend/{NAME}0")}})
        gateway("/v3/auth/user/add", {"name": "kvblend", "password": PASSWORD})
        gateway("/v3/auth/user/grant", {"user": "kvblend", "role": "kvb"})
        gateway("/v3/auth/enable", {})

    def flags(n, **over):
        """The daemon's etcd flags; over replaces one (value None: leave it out)."""
        f = {"--node-id": n, "--cluster-name": NAME, "--cluster-etcd": ETCD.url,
             "--cluster-etcd-ca-file": TLS["ca"], "--cluster-etcd-cert-file": TLS["client_cert"],
             "--cluster-etcd-key-file": TLS["client_key"], "--cluster-etcd-user": "kvblend",
             "--cluster-etcd-password-file": f"{TMP}/password"}
        for k, v in over.items():
            f["--" + k.replace("_", "-")] = v
        return [x for k, v in f.items() if v is not None for x in (k, v)]

    def refused(n, **over):
        """Start a daemon that must not start: (exit status, stderr)."""
        r = subprocess.run([kvblendd, "--data-dir", f"{TMP}/x", "--listen",
                            f"ipc://{TMP}/x.sock,tcp://127.0.0.1:{kvbtest.free_port()}",
                            *flags(n, **over)], capture_output=True, text=True, timeout=30,
                           check=False)
        return r.returncode, r.stderr

    def start(n):
        d = kvbtest.Daemon(kvblendd, kvblend, TMP, *flags(n), "--map-size", "1G", name=n,
                           listen=f"ipc://{TMP}/{n}.sock,tcp://127.0.0.1:{PORTS[n]}")
        daemons[n] = d
        return d.start()

    def cmdline(pid):
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()

    def alive(n):
        members = json.loads(cli(n, "cluster", "status", "--json").stdout)["members"]
        return {m["id"] for m in members if m["state"] == "alive"}

    wait_for = kvbtest.wait_for

    try:
        # 1. refused before any call
        rc, err = refused("x", cluster_etcd="http://127.0.0.1:1")
        check("a TLS file with an http:// endpoint is refused, named",
              rc != 0 and "cluster_etcd_ca_file" in err and "https://" in err, err)
        rc, err = refused("x", cluster_etcd_key_file=None)
        check("a client certificate without its key is refused, named",
              rc != 0 and "cluster_etcd_key_file" in err, err)
        rc, err = refused("x", cluster_etcd_password_file=None)
        check("a user without a password file is refused, named",
              rc != 0 and "cluster_etcd_password_file" in err, err)
        rc, err = refused("x", cluster_etcd_password_file=f"{TMP}/no-such-file")
        check("a password file that cannot be read is refused, named",
              rc != 0 and "cluster_etcd_password_file" in err and "no-such-file" in err, err)
        rc, err = refused("x", cluster_etcd_password_file=f"{TMP}/empty-password")
        check("an empty password file is refused, named",
              rc != 0 and "cluster_etcd_password_file" in err and "empty" in err, err)

        check("etcd starts with TLS and client certificates", ETCD.start(),
              ETCD.log_text()[-2000:])
        set_up_auth()
        try:
            r = gateway("/v3/kv/range", {"key": b64(f"/kvblend/{NAME}/")})
            check("etcd refuses a call without a token (authentication is on)", False, str(r))
        except urllib.error.HTTPError as e:
            body = e.read().decode()
            check("etcd refuses a call without a token (authentication is on)",
                  "user name is empty" in body or "permission denied" in body, body)

        # 2. what etcd refuses stops the start
        rc, err = refused("x", cluster_etcd_ca_file=f"{TMP}/other-ca.pem")
        check("a CA that did not sign etcd's certificate: refused at start, named",
              rc != 0 and "cluster_etcd_ca_file" in err and "not trusted" in err, err)
        rc, err = refused("x", cluster_etcd_cert_file=None, cluster_etcd_key_file=None)
        check("no client certificate: refused at start, named",
              rc != 0 and "client certificate" in err and "cluster_etcd_cert_file" in err, err)
        rc, err = refused("x", cluster_etcd_password_file=f"{TMP}/wrong-password")
        check("a wrong password: refused at start, named",
              rc != 0 and "authentication failed" in err and "'kvblend'" in err, err)
        rc, err = refused("x", cluster_name="elsewhere")
        check("a user with no permission on the cluster's prefix: refused at start, named",
              rc != 0 and "permission denied" in err, err)
        rc, err = refused("x", cluster_etcd_user=None, cluster_etcd_password_file=None)
        check("no user while etcd wants one: refused at start, named",
              rc != 0 and "cluster_etcd_user" in err, err)

        # 3. two daemons through it
        for n in "ab":
            check(f"{n} starts with TLS, a client certificate and a password", start(n),
                  daemons[n].log_text()[-2000:])
        ok = wait_for(lambda: all(alive(n) == set("ab") for n in "ab"), 20)
        check("a and b find each other through etcd over TLS", ok, str({n: alive(n) for n in "ab"}))
        check("the password is on no command line",
              all(PASSWORD not in cmdline(d.proc.pid) for d in daemons.values()))
        cc.add_model(cli, "a")
        rng = np.random.default_rng(20)
        chunks = cc.put_chunks(cli, TMP, "a", 0, 4, rng)
        bad = cc.readable(cli, TMP, "b", chunks)
        check("chunks PUT through a read back byte for byte through b", not bad, str(bad))

        # 4. tokens expire every 2 s; the lease is renewed every 3.3 s with a new one. A call
        # may time out on a loaded machine (etcd hashes the password at every authentication:
        # seen at load 30), so what is checked is that no call failed on its token: a daemon
        # that did not authenticate again would log etcd's "invalid auth token" and stay down.
        time.sleep(12)
        st = {n: stats(n) for n in "ab"}
        auth_words = ("invalid auth token", "auth store is old", "authentication failed",
                      "permission denied")
        auth_errs = {n: [ln for ln in daemons[n].log_text().splitlines()
                         if any(w in ln for w in auth_words)] for n in "ab"}
        check("after 12 s of 2 s tokens: etcd up on both, no call failed on its token",
              all(s["cluster_etcd_ok"] == 1 for s in st.values())
              and not any(auth_errs.values()),
              str({n: (s["cluster_etcd_ok"], s["cluster_etcd_errors"], auth_errs[n][-3:])
                   for n, s in st.items()}))
        check("c starts", start("c"), daemons["c"].log_text()[-2000:])
        ok = wait_for(lambda: all(alive(n) == set("abc") for n in "abc"), 20)
        check("a third member joining is seen by all three", ok,
              str({n: alive(n) for n in "abc"}))
        bad = cc.readable(cli, TMP, "c", chunks)
        check("the chunks read back byte for byte through c", not bad, str(bad))
    finally:
        cc.stop_all(daemons, check)
        ETCD.stop()
        kvbtest.remove(TMP)
    check.done()
