#!/bin/sh
# Make zeroserve's Secrets for Kubernetes and print them as YAML:
#
#   deploy/kubernetes/secrets.sh KEY_DIR NUM_WORKERS [WORKER_ID ...] | kubectl apply -n zeroserve -f -
#
# WORKER_IDs: keys for workers of other groups too (overlays/second-model: worker-second-0).
# KEY_DIR gets a new CurveZMQ key set (`zeroserve keys generate`: the gateways' shared pair
# and worker-0 .. worker-(NUM_WORKERS-1)) unless it already holds one, and an API key file
# (api-keys: one serving key a line; admin-key) unless it has them. Keep KEY_DIR private
# (it holds every secret) or delete it once applied; run again with the same KEY_DIR to
# re-print the same Secrets. NUM_WORKERS: at least the ScaledObject's maxReplicaCount.
#
#   zeroserve-gateway-keys  the gateways' secret key + every worker's public key
#   zeroserve-worker-keys   the gateways' public key + every worker's secret key (each
#                           worker pod copies out only its own, worker.yaml)
#   zeroserve-api-keys      api-keys (comma-separated), metrics-key (for Prometheus),
#                           admin-key (for `zeroserve workers ...`)
#
# Needs `zeroserve` (or ZEROSERVE="docker run --rm -v $PWD:$PWD -w $PWD zeroserve:cpu
# zeroserve"), kubectl (only to format the YAML: no cluster is contacted) and python3.
set -eu
if [ $# -lt 2 ]; then
  echo "usage: $0 KEY_DIR NUM_WORKERS [WORKER_ID ...]" >&2
  exit 2
fi
dir=$1
num_workers=$2
shift 2
zeroserve=${ZEROSERVE:-zeroserve}
kubectl=${KUBECTL:-kubectl}
umask 077
workers=""
i=0
while [ "$i" -lt "$num_workers" ]; do
  workers="$workers worker-$i"
  i=$((i + 1))
done
workers="$workers $*"
if [ ! -f "$dir/gateway.key_secret" ]; then
  ids=""
  for w in $workers; do ids="$ids --worker-id $w"; done
  # shellcheck disable=SC2086  # the flags split on purpose
  $zeroserve keys generate "$dir" $ids >&2
fi
for w in $workers; do
  if [ ! -f "$dir/workers/$w.key_secret" ]; then
    echo "$dir has no key for $w: use a new KEY_DIR (every key is reissued)" >&2
    exit 1
  fi
done
token() { python3 -c 'import secrets; print("sk-" + secrets.token_urlsafe(32))'; }
[ -f "$dir/api-keys" ] || token > "$dir/api-keys"
[ -f "$dir/admin-key" ] || token > "$dir/admin-key"
api_keys=$(grep -v '^#' "$dir/api-keys" | grep . | paste -sd, -)
metrics_key=${api_keys%%,*}

gateway_files="--from-file=gateway.key_secret=$dir/gateway.key_secret"
worker_files="--from-file=gateway.key=$dir/gateway.key"
for w in $workers; do
  gateway_files="$gateway_files --from-file=$w.key=$dir/workers/$w.key"
  worker_files="$worker_files --from-file=$w.key_secret=$dir/workers/$w.key_secret"
done
# shellcheck disable=SC2086  # the file flags split on purpose
$kubectl create secret generic zeroserve-gateway-keys $gateway_files --dry-run=client -o yaml
echo "---"
# shellcheck disable=SC2086
$kubectl create secret generic zeroserve-worker-keys $worker_files --dry-run=client -o yaml
echo "---"
$kubectl create secret generic zeroserve-api-keys --from-literal=api-keys="$api_keys" \
  --from-literal=metrics-key="$metrics_key" \
  --from-literal=admin-key="$(grep . "$dir/admin-key" | head -n 1)" --dry-run=client -o yaml
