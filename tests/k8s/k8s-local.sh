#!/bin/bash
# Real Kubernetes 1.20.2 (kube-apiserver, controller-manager, scheduler, kubelets) + etcd 3.4 + containerd 1.6/runc
# on Debian 12 (bookworm), from Debian packages only: binaries are built from Debian's kubernetes 1.20.2 source package.
# Run as root. L (default /var/cache/k8s-local) holds everything: source, Go cache, binaries, PKI, images, state, logs.
usage() { cat <<'EOF'
Usage: L=/some/dir k8s-local.sh COMMAND
  missing     print the Debian packages the other commands need that are not installed (empty: none)
  check       exit 0 when nothing is missing and the binaries are built from this script's source version
  install     apt-get install those packages (and add deb-src lines for `apt-get source`)
  build       build kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl into $L/bin;
              a no-op when they are there and were built from K8S_SRC_VERSION (recorded in $L/bin/VERSION)
  ensure      install (only when a package is missing) + build
  start       stop what an earlier run left, then PKI, images and daemons; waits for node "localhost" Ready
  addnode N   extra real node "127.0.0.N" (N in 2..9), its own containerd and kubelet; waits for it Ready
  up          ensure + start + addnode 2 (nothing when both nodes are already Ready)
  status      exit 0 when every daemon started is alive, the API server is ready and every node is Ready
  images      build the pause, busybox and busybox-python image tarballs if missing, import them on every running node
  stop        kill what start/addnode started (pid files), unmount, remove bridges, restore sysctls
EOF
}
set -eEuo pipefail
trap 'rc=$?; [[ $BASH_COMMAND == return* ]] || echo "k8s-local.sh: line $LINENO: exit $rc from: $BASH_COMMAND" >&2' ERR
L=${L:-/var/cache/k8s-local}; P=$L/pki; B=$L/bin; R=$L/run
K8S_SRC_VERSION=1.20.5+really1.20.2-1.1+deb12u1      # Debian source package version (apt-get source kubernetes=...)
K8S_VERSION=1.20.2                                   # the upstream version inside it (what `kubectl version` says)
SRC=kubernetes-${K8S_SRC_VERSION%-*}                 # the directory dpkg-source extracts: kubernetes-1.20.5+really1.20.2
BINS="kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl"
STAMP="$K8S_SRC_VERSION bins=${BINS// /,} recipe=1"   # bump recipe when the build steps change: forces a rebuild
# Debian packages the commands need (dpkg names). kubectl is built here (the one on PATH, if any, may be anything).
PACKAGES="golang-go etcd-server containerd runc containernetworking-plugins busybox-static iptables conntrack dpkg-dev
  gcc libc6-dev openssl curl python3 util-linux"
export KUBECONFIG=$P/admin.kubeconfig
KUBECTL=$B/kubectl; [ -x $KUBECTL ] || KUBECTL=kubectl
CTR="ctr --address $R/containerd/containerd.sock -n k8s.io"

missing() {
  local p out=()
  for p in $PACKAGES; do
    [ "$(dpkg-query -W -f='${db:Status-Abbrev}' $p 2>/dev/null)" = "ii " ] || out+=($p)
  done
  echo "${out[*]}"
}

have_src_lines() { grep -rqs -e '^Types:.*deb-src' -e '^deb-src ' /etc/apt/sources.list /etc/apt/sources.list.d/; }

built() {
  [ "$(cat $B/VERSION 2>/dev/null)" = "$STAMP" ] || return 1
  local c; for c in $BINS; do [ -x $B/$c ] || return 1; done
}

check() {
  local m; m=$(missing); local ok=0
  [ -z "$m" ] || { echo "missing Debian packages: $m"; ok=1; }
  built || { echo "not built: $BINS from kubernetes $K8S_SRC_VERSION in $B"; ok=1; }
  [ $ok = 1 ] || echo "ready: $BINS (v$K8S_VERSION) in $B"
  return $ok
}

install() {
  # deb-src lines for the suites apt already uses (the full kubernetes source package is only in bookworm)
  if ! have_src_lines; then
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
      sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > /etc/apt/sources.list.d/deb-src.sources
    elif [ -f /etc/apt/sources.list ]; then
      sed -n 's/^deb /deb-src /p' /etc/apt/sources.list > /etc/apt/sources.list.d/deb-src.list
    fi
  fi
  apt-get update -q
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $PACKAGES
}

build() {
  mkdir -p $L/logs $B; exec 9>$L/build.lock; flock 9   # one build at a time (two `make test` on one machine)
  if built; then echo "build: nothing to do, $B has $BINS from kubernetes $K8S_SRC_VERSION"; return 0; fi
  rm -f $B/VERSION
  mkdir -p $L/src && cd $L/src
  # another source version from an earlier recipe: remove it (and its tarballs) before fetching this one
  find $L/src -mindepth 1 -maxdepth 1 -name 'kubernetes[-_]*' ! -name "$SRC" ! -name "kubernetes_${K8S_SRC_VERSION%-*}*" -exec rm -rf {} +
  [ -d $SRC ] || apt-get source -q kubernetes=$K8S_SRC_VERSION   # full upstream tree incl. vendor/ + Debian CVE patches
  export GOPATH=$L/gopath GO111MODULE=off GOPROXY=off GOFLAGS= GOCACHE=${GOCACHE:-$L/gocache} CGO_ENABLED=0
  mkdir -p $GOPATH/src/k8s.io; ln -sfn $L/src/$SRC $GOPATH/src/k8s.io/kubernetes
  cd $GOPATH/src/k8s.io/kubernetes
  # pkg/generated/openapi is generated by upstream's make, not shipped: generate it with the vendored openapi-gen
  if ! [ -f pkg/generated/openapi/zz_generated.openapi.go ]; then
    go build -o $B/openapi-gen k8s.io/kubernetes/vendor/k8s.io/kube-openapi/cmd/openapi-gen
    IN=$(grep -Rl --include='*.go' '+k8s:openapi-gen=' pkg cmd plugin vendor/k8s.io/ | grep -v '_test.go$' | xargs -n1 dirname | LC_ALL=C sort -u \
         | grep -vE 'code-generator|kube-openapi|sample-apiserver' | sed 's|^|k8s.io/kubernetes/|' | paste -sd,)
    $B/openapi-gen -i "$IN" -p k8s.io/kubernetes/pkg/generated/openapi -O zz_generated.openapi \
      -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt -r $L/logs/openapi-violations.report -o $GOPATH/src
  fi
  local LDF="-s -w" v c
  for v in k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
    LDF="$LDF -X $v.gitVersion=v$K8S_VERSION -X $v.gitMajor=${K8S_VERSION%%.*} -X $v.gitMinor=$(echo $K8S_VERSION | cut -d. -f2)"
    LDF="$LDF -X $v.gitTreeState=clean -X $v.buildDate=2021-01-13T00:00:00Z"; done
  for c in $BINS; do
    echo "building $c $(date +%T)"; go build -ldflags "$LDF" -o $B/$c k8s.io/kubernetes/cmd/$c; done
  echo "$STAMP" > $B/VERSION
  echo "built $(date +%T)"; ls -la $B
}

ensure() {
  if [ -n "$(missing)" ] || { ! built && ! [ -d $L/src/$SRC ] && ! have_src_lines; }; then install; fi
  build
}

pki() {
  mkdir -p $P && cd $P
  # the certificates are valid 365 days: a cache older than that gets a new PKI (every node's certificates included)
  if [ -f ca.crt ] && ! openssl x509 -checkend 86400 -noout -in ca.crt >/dev/null; then rm -f $P/*; fi
  [ -f ca.crt ] && return 0
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 365 -subj "/CN=k8s-local-ca" 2>/dev/null
  mk() { openssl req -newkey rsa:2048 -nodes -keyout $1.key -out $1.csr -subj "/CN=$2${3:+/O=$3}" 2>/dev/null
         if [ -n "${4:-}" ]; then printf "subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n" "$4" > $1.ext; else printf "extendedKeyUsage=clientAuth\n" > $1.ext; fi
         openssl x509 -req -in $1.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out $1.crt -days 365 -extfile $1.ext 2>/dev/null; }
  mk apiserver kube-apiserver "" "IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  mk apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  mk admin admin system:masters; mk controller-manager system:kube-controller-manager; mk scheduler system:kube-scheduler
  mk kubelet-client system:node:localhost system:nodes      # node is named "localhost" so the apiserver reaches its kubelet on 127.0.0.1
  mk kubelet-serving localhost "" "IP:127.0.0.1,DNS:localhost"
  openssl genrsa -out sa.key 2048 2>/dev/null; openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  for u in admin controller-manager scheduler kubelet-client; do
    printf 'apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster: {server: "https://127.0.0.1:6443", certificate-authority: %s/ca.crt}\nusers:\n- name: %s\n  user: {client-certificate: %s/%s.crt, client-key: %s/%s.key}\ncontexts:\n- name: local\n  context: {cluster: local, user: %s}\ncurrent-context: local\n' $P $u $P $u $P $u $u > $P/${u%-client}.kubeconfig
  done
}

build_images() {  # pause image (k8s' pause.c, static) and a busybox image, as docker-archive tarballs
  mkdir -p $L/images && cd $L/images; [ -f busybox.tar ] && return 0
  cat > mkimage.py <<'EOF'
import hashlib, io, json, os, sys, tarfile
rootfs, ref, out, cmd = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
    for n in sorted(os.listdir(rootfs)): t.add(os.path.join(rootfs, n), arcname=n)
layer = buf.getvalue(); lsha = hashlib.sha256(layer).hexdigest()
cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": cmd, "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
                  "rootfs": {"type": "layers", "diff_ids": ["sha256:" + lsha]}}).encode(); csha = hashlib.sha256(cfg).hexdigest()
man = json.dumps([{"Config": csha + ".json", "RepoTags": [ref], "Layers": [lsha + "/layer.tar"]}]).encode()
with tarfile.open(out, "w") as t:
    for n, d in ((lsha + "/layer.tar", layer), (csha + ".json", cfg), ("manifest.json", man)):
        ti = tarfile.TarInfo(n); ti.size = len(d); t.addfile(ti, io.BytesIO(d))
EOF
  mkdir -p pause-root; gcc -Os -static -DVERSION=local -o pause-root/pause $L/src/$SRC/build/pause/linux/pause.c
  python3 mkimage.py pause-root k8s.gcr.io/pause:3.2 pause.tar /pause
  rm -rf bb && mkdir -p bb/bin bb/tmp bb/etc bb/root && cp /bin/busybox bb/bin/
  for a in $(bb/bin/busybox --list); do [ -e bb/bin/$a ] || ln -s busybox bb/bin/$a; done
  echo 'root:x:0:0:root:/root:/bin/sh' > bb/etc/passwd; echo 'root:x:0:' > bb/etc/group
  python3 mkimage.py bb docker.io/library/busybox:local busybox.tar.tmp sh && mv busybox.tar.tmp busybox.tar
}

build_python_image() {  # busybox + this machine's own python3 (Debian's, with its libraries): pods that have Python
  mkdir -p $L/images && cd $L/images; [ -f python.tar ] && return 0; build_images; cd $L/images
  local py lib f; py=$(readlink -f /usr/bin/python3); lib=/usr/lib/$(basename $py)
  rm -rf py && cp -a bb py && mkdir -p py/usr/bin py/usr/lib && cp $py py/usr/bin/ && ln -s $(basename $py) py/usr/bin/python3
  cp -a $lib py/usr/lib/ && rm -rf py$lib/test py$lib/idlelib py$lib/tkinter py$lib/ensurepip py$lib/site-packages
  for f in $(ldd $py $lib/lib-dynload/*.so | awk '/=>/{print $3} /ld-linux/{print $1}' | sort -u); do
    mkdir -p py$(dirname $f) && cp -L $f py$f; done
  python3 mkimage.py py docker.io/library/busybox-python:local python.tar.tmp sh && mv python.tar.tmp python.tar
}

pod_routes() {  # pods reach the pods of every node (10.244.0.0/16 through their bridge), as Kubernetes' network
  # model wants: a node agent talks to its head pod on another node. Also for a cluster started by an
  # older copy of this script (only pods created afterwards get the route).
  sed -i 's|"routes": \[{"dst": "10.244.[0-9]*.0/24"}\]|"routes": [{"dst": "10.244.0.0/16"}]|' $L/cni/10-local.conflist $L/node*/cni/10-local.conflist 2>/dev/null || true
}

images() {  # build the image tarballs if missing and import them into every running containerd (every node)
  build_images; build_python_image; pod_routes; local f sock
  for f in $R/containerd*.pid; do [ -f $f ] && ours "$(cat $f)" || continue
    sock=$R/$(basename $f .pid)/containerd.sock
    ctr --address $sock -n k8s.io images import $L/images/pause.tar >/dev/null
    ctr --address $sock -n k8s.io images import $L/images/busybox.tar >/dev/null
    ctr --address $sock -n k8s.io images import $L/images/python.tar >/dev/null; echo "images imported into $sock"
  done
}

configs() {
  mkdir -p $L/cni
  cat > $L/containerd.toml <<EOF
version = 2
root = "$R/containerd/root"
state = "$R/containerd/state"
[grpc]
  address = "$R/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "k8s.gcr.io/pause:3.2"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true   # no CAP_SYS_RESOURCE in this VM: runc cannot set negative oom_score_adj otherwise
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$R/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$L/cni"
EOF
  cat > $L/cni/10-local.conflist <<EOF
{"cniVersion": "0.4.0", "name": "k8slocal", "plugins": [
  {"type": "bridge", "bridge": "k8slab0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$R/cni-ipam", "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "10.244.0.0/16"}]}},
  {"type": "loopback"}]}
EOF
  cat > $L/kubelet.yaml <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: $P/ca.crt}}
authorization: {mode: Webhook}
tlsCertFile: $P/kubelet-serving.crt
tlsPrivateKeyFile: $P/kubelet-serving.key
cgroupDriver: cgroupfs
failSwapOn: false
makeIPTablesUtilChains: false
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
EOF
}

# a daemon in its own session (a Ctrl-C in the terminal that started it does not reach it), lock fds closed
bg() { local name=$1; shift; nohup setsid "$@" > $L/logs/$name.log 2>&1 < /dev/null 7>&- 9>&- & echo $! > $R/$name.pid; }
alive() { [ -r /proc/$1/stat ] && [ "$(sed 's/.*) //' /proc/$1/stat 2>/dev/null | cut -d' ' -f1)" != Z ]; }   # a zombie is gone
ours() { alive $1 && tr '\0' ' ' < /proc/$1/cmdline 2>/dev/null | grep -qF "$L/"; }   # not a recycled pid after a reboot
api_ready() { curl -sf --max-time 5 --cacert $P/ca.crt --cert $P/admin.crt --key $P/admin.key https://127.0.0.1:6443/readyz >/dev/null 2>&1; }
node_ready() { $KUBECTL get node "$1" --no-headers 2>/dev/null | grep -qw Ready; }
wait_node() {  # wait_node NAME SECONDS LOG: fail with the log's tail when the node is not Ready in time
  local i; for i in $(seq $2); do node_ready $1 && return 0; sleep 1; done
  echo "node $1 not Ready after $2 s; last lines of $3:" >&2; tail -n 30 $3 >&2 || true; return 1
}
leftovers() {  # anything an earlier start left: pid files, mounts under $R, bridges, saved sysctls
  ls $R/*.pid >/dev/null 2>&1 || grep -q " $R/" /proc/mounts || ls /sys/class/net | grep -q "^k8slab[0-9]" || [ -f $R/sysctl.saved ]
}

addnode() {  # extra node N (2..9): own containerd, CNI bridge and kubelet on 127.0.0.N, node name "127.0.0.N"
  local n=${1:-} ip=127.0.0.${1:-} d=$L/node${1:-}
  [[ $n =~ ^[2-9]$ ]] || { echo "addnode: N must be 2..9" >&2; return 2; }
  mkdir -p $d
  if [ -f $R/kubelet$n.pid ] && ours "$(cat $R/kubelet$n.pid)"; then
    echo "node $ip already running"; wait_node $ip 120 $L/logs/kubelet$n.log; return; fi
  cd $P; if ! [ -f kubelet$n-client.crt ]; then
    openssl req -newkey rsa:2048 -nodes -keyout kubelet$n-client.key -out kubelet$n-client.csr -subj "/CN=system:node:$ip/O=system:nodes" 2>/dev/null
    printf "extendedKeyUsage=clientAuth\n" > kubelet$n-client.ext
    openssl x509 -req -in kubelet$n-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out kubelet$n-client.crt -days 365 -extfile kubelet$n-client.ext 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout kubelet$n-serving.key -out kubelet$n-serving.csr -subj "/CN=$ip" 2>/dev/null
    printf "subjectAltName=IP:$ip\nextendedKeyUsage=serverAuth\n" > kubelet$n-serving.ext
    openssl x509 -req -in kubelet$n-serving.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out kubelet$n-serving.crt -days 365 -extfile kubelet$n-serving.ext 2>/dev/null
    sed "s|kubelet-client|kubelet$n-client|g" kubelet.kubeconfig > kubelet$n.kubeconfig
  fi
  sed -e "s|$R/containerd/|$R/containerd$n/|; s|$R/runc\"|$R/runc$n\"|; s|conf_dir = \"$L/cni\"|conf_dir = \"$d/cni\"|" $L/containerd.toml > $d/containerd.toml
  mkdir -p $d/cni; sed -e "s/k8slab0/k8slab$n/; s|$R/cni-ipam|$R/cni-ipam$n|; s|10.244.0.0/24|10.244.$n.0/24|g" $L/cni/10-local.conflist > $d/cni/10-local.conflist
  sed -e "s/^address: 127.0.0.1/address: $ip/; s/^healthzBindAddress: 127.0.0.1/healthzBindAddress: $ip/; s/kubelet-serving/kubelet$n-serving/g" $L/kubelet.yaml > $d/kubelet.yaml
  printf 'cgroupsPerQOS: false\nenforceNodeAllocatable: []\n' >> $d/kubelet.yaml   # keep each kubelet away from the other one's pod cgroups
  # containerd N + kubelet N share a private mount namespace in which /var/log/pods is their own directory:
  # kubelets that share /var/log/pods delete each other's pod logs (container GC of "deleted" pods).
  mkdir -p $d/var-log-pods /var/log/pods
  cat > $d/run.sh <<EOF
mount --bind $d/var-log-pods /var/log/pods
rm -f $R/containerd$n/containerd.sock $R/containerd$n/containerd.sock.ttrpc
containerd --config $d/containerd.toml > $L/logs/containerd$n.log 2>&1 &
echo \$! > $R/containerd$n.pid
for i in \$(seq 120); do ctr --address $R/containerd$n/containerd.sock version >/dev/null 2>&1 && break; sleep 0.5; done
ctr --address $R/containerd$n/containerd.sock -n k8s.io images import $L/images/pause.tar >/dev/null
ctr --address $R/containerd$n/containerd.sock -n k8s.io images import $L/images/busybox.tar >/dev/null
[ -f $L/images/python.tar ] && ctr --address $R/containerd$n/containerd.sock -n k8s.io images import $L/images/python.tar >/dev/null
exec $B/kubelet --config=$d/kubelet.yaml --kubeconfig=$P/kubelet$n.kubeconfig --root-dir=$R/kubelet$n --hostname-override=$ip \
  --container-runtime=remote --container-runtime-endpoint=unix://$R/containerd$n/containerd.sock
EOF
  bg kubelet$n unshare -m --propagation slave bash $d/run.sh
  wait_node $ip 120 $L/logs/kubelet$n.log
  $KUBECTL get nodes -o wide
}

start() {
  mkdir -p $L/logs $R
  local c; for c in $BINS; do [ -x $B/$c ] || { echo "start: $B/$c missing: run build first (make k8s)" >&2; return 1; }; done
  if leftovers; then echo "start: stopping what an earlier run left first"; stop; fi
  rm -rf $R/etcd   # a fresh API state every start: no pods, namespaces or nodes from an earlier run
  pki; build_images; configs
  # the kubelet sets kernel.panic, kernel.panic_on_oops and vm.overcommit_memory: stop puts these values back
  sysctl -n kernel.panic kernel.panic_on_oops vm.overcommit_memory | paste -sd' ' > $R/sysctl.saved
  bg etcd etcd --name local --data-dir $R/etcd --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster local=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381
  bg kube-apiserver $B/kube-apiserver --etcd-servers=http://127.0.0.1:2379 --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port=6443 --insecure-port=0 \
    --cert-dir=$R/apiserver-certs --tls-cert-file=$P/apiserver.crt --tls-private-key-file=$P/apiserver.key --client-ca-file=$P/ca.crt \
    --service-account-key-file=$P/sa.pub --service-account-signing-key-file=$P/sa.key --service-account-issuer=https://kubernetes.default.svc \
    --service-cluster-ip-range=10.0.0.0/24 --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction --allow-privileged=true \
    --kubelet-client-certificate=$P/apiserver-kubelet-client.crt --kubelet-client-key=$P/apiserver-kubelet-client.key \
    --kubelet-certificate-authority=$P/ca.crt --kubelet-preferred-address-types=Hostname
  local i; for i in $(seq 120); do api_ready && break; sleep 0.5; done
  api_ready || { echo "kube-apiserver not ready after 60 s:" >&2; tail -n 30 $L/logs/kube-apiserver.log $L/logs/etcd.log >&2; return 1; }
  bg kube-controller-manager $B/kube-controller-manager --kubeconfig=$P/controller-manager.kubeconfig --authentication-kubeconfig=$P/controller-manager.kubeconfig \
    --authorization-kubeconfig=$P/controller-manager.kubeconfig --bind-address=127.0.0.1 --port=0 --leader-elect=false --controllers='*,-nodeipam' \
    --service-account-private-key-file=$P/sa.key --root-ca-file=$P/ca.crt --use-service-account-credentials=true
  bg kube-scheduler $B/kube-scheduler --kubeconfig=$P/scheduler.kubeconfig --authentication-kubeconfig=$P/scheduler.kubeconfig \
    --authorization-kubeconfig=$P/scheduler.kubeconfig --bind-address=127.0.0.1 --port=0 --leader-elect=false
  rm -f $R/containerd*/containerd.sock $R/containerd*/containerd.sock.ttrpc   # stale ones answer nothing
  bg containerd containerd --config $L/containerd.toml
  # wait until containerd answers, not until its socket file exists: a killed containerd leaves the file behind
  for i in $(seq 120); do $CTR version >/dev/null 2>&1 && break; sleep 0.5; done
  $CTR images import $L/images/pause.tar >/dev/null; $CTR images import $L/images/busybox.tar >/dev/null
  [ -f $L/images/python.tar ] && $CTR images import $L/images/python.tar >/dev/null
  bg kubelet $B/kubelet --config=$L/kubelet.yaml --kubeconfig=$P/kubelet.kubeconfig --root-dir=$R/kubelet --hostname-override=localhost \
    --container-runtime=remote --container-runtime-endpoint=unix://$R/containerd/containerd.sock
  wait_node localhost 120 $L/logs/kubelet.log
  for i in $(seq 60); do $KUBECTL get sa default >/dev/null 2>&1 && break; sleep 1; done
  $KUBECTL get nodes -o wide
}

up() {
  ensure
  if status >/dev/null 2>&1 && node_ready 127.0.0.2; then echo "up: already running"; $KUBECTL get nodes; return 0; fi
  start; addnode 2
}

status() {  # every daemon with a pid file alive, API server ready, every registered node Ready
  local f ok=0 n
  ls $R/*.pid >/dev/null 2>&1 || { echo "not running (no pid files in $R)"; return 1; }
  for f in $R/*.pid; do n=$(basename $f .pid)
    if ours "$(cat $f)"; then echo "$n: running, pid $(cat $f)"; else echo "$n: DEAD (see $L/logs/$n.log)"; ok=1; fi
  done
  api_ready || { echo "kube-apiserver: not ready"; return 1; }
  local nodes; nodes=$($KUBECTL get nodes --no-headers 2>/dev/null) || { echo "cannot list nodes"; return 1; }
  echo "$nodes"
  [ -n "$nodes" ] && ! echo "$nodes" | awk '{print $2}' | grep -qvx Ready || ok=1
  return $ok
}

stop() {
  mkdir -p $R
  if [ -x $B/kubectl ] && api_ready; then timeout 30 $KUBECTL delete pods --all -A --grace-period=0 --force >/dev/null 2>&1 || true; fi
  # stopall NAME...: SIGTERM to each daemon of a pid file (only if it is still ours: its command line names $L),
  # wait for all together (10 s at most), then SIGKILL what is left
  stopall() { local n p ps=() i
    for n in "$@"; do [ -f $R/$n.pid ] || continue; p=$(cat $R/$n.pid); rm -f $R/$n.pid
      ours $p && kill $p 2>/dev/null && ps+=($p) || true; done
    for i in $(seq 40); do
      for p in ${ps[@]+"${ps[@]}"}; do alive $p && break; p=; done; [ -z "${p:-}" ] && break; sleep 0.25; done
    for p in ${ps[@]+"${ps[@]}"}; do alive $p && kill -9 $p 2>/dev/null || true; done; }
  stopall $(cd $R && ls kubelet*.pid 2>/dev/null | sed 's/\.pid$//')
  for sock in $R/containerd*/containerd.sock; do [ -S $sock ] || continue
    for t in $(ctr --address $sock -n k8s.io tasks ls -q 2>/dev/null); do ctr --address $sock -n k8s.io tasks kill -s KILL $t >/dev/null 2>&1 || true; sleep 0.2; done
    for s in $(pgrep -f "containerd-shim-runc-v2 -namespace k8s.io .*-address $sock" || true); do kill $s || true; done; done
  stopall kube-scheduler kube-controller-manager kube-apiserver $(cd $R && ls containerd*.pid 2>/dev/null | sed 's/\.pid$//')
  stopall etcd
  { grep -o " $R/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do umount -l $m; done
  for b in $(ls /sys/class/net | grep "^k8slab[0-9]" || true); do ip link del $b; done
  if [ -f $R/sysctl.saved ]; then   # the values from before the kubelet ran (start saved them)
    read -r panic oops overcommit < $R/sysctl.saved
    sysctl -q -w kernel.panic=$panic kernel.panic_on_oops=$oops vm.overcommit_memory=$overcommit; rm -f $R/sysctl.saved
  fi
  echo stopped
}

case ${1:-} in
  missing|check|install|build|ensure|status|images) "$@" ;;
  start|stop|addnode|up) mkdir -p $L; exec 7>$L/ctl.lock; flock 7; "$@" ;;   # one start/stop at a time
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
