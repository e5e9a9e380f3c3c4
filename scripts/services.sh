#!/usr/bin/env bash
# scripts/services.sh -- install and run jobstream's local services (no Docker).
#
#   * Apache Kafka 4.1.1, KRaft mode, one combined broker+controller node,
#     jars fetched from Maven Central with scripts/kafka-pom.xml.
#   * PostgreSQL from Debian's packages, with a project-owned cluster.
#
# Everything lives under $JOBSTREAM_HOME (default: <repo root>/.local).
# Run `scripts/services.sh --help` for usage.

# shellcheck disable=SC2016  # single-quoted `bash -c` bodies expand in the child on purpose
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/services.sh {up|down|status|env} [--help]
       scripts/services.sh {start|stop|restart|status} [kafka|postgres|connect] [--immediate]
       scripts/services.sh fetch [kafka|connect]

Commands
  up       Install (if needed) and start Kafka and PostgreSQL. Idempotent: a
           service that already answers at its configured address is reused.
           With JOBSTREAM_RELAY=debezium also a Kafka Connect worker (distributed
           mode) with the Debezium PostgreSQL connector and its Outbox Event Router.
  down     Stop the services this script started (Kafka via its pid file,
           PostgreSQL via pg_ctl). Services it did not start are left alone.
  status   Print up/down for each service; exit 0 if both answer, 3 otherwise.
  env      Print `export ...` lines for the project settings:
             eval "$(scripts/services.sh env)"

  start [SERVICE]                 `up` for one service (kafka, postgres or connect); all without SERVICE.
  stop [SERVICE] [--immediate]    `down` for one service; all without SERVICE.
           --immediate simulates a crash instead of a clean shutdown: Kafka gets
           SIGKILL, PostgreSQL `pg_ctl stop -m immediate` (crash recovery on start).
  restart SERVICE [--immediate]   stop, then start one service (what a fault test needs).
  status SERVICE                  up/down of one service; exit 0 if it answers, 3 otherwise.
  fetch [kafka|connect]           install what `start` needs (Java, the jars from Maven Central)
           without starting anything; both without SERVICE. .ci/run fetches Connect's jars
           this way while lint and type checks run, not inside the Debezium tests.

Environment (all optional)
  JOBSTREAM_HOME                     state dir            (default: <repo>/.local)
  JOBSTREAM_KAFKA_PORT               broker port          (default: 9092)
  JOBSTREAM_KAFKA_CONTROLLER_PORT    KRaft controller port (default: 9093)
  JOBSTREAM_PG_PORT                  PostgreSQL port      (default: 55432)
  JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS  or KAFKA_BOOTSTRAP_SERVERS: Kafka to use/reuse
                                     (default: 127.0.0.1:$JOBSTREAM_KAFKA_PORT)
  JOBSTREAM_DATABASE_URL             or DATABASE_URL: PostgreSQL to use/reuse
                   (default: postgresql://jobstream:jobstream@127.0.0.1:$JOBSTREAM_PG_PORT/jobstream)
  JOBSTREAM_KAFKA_HEAP_OPTS          broker heap          (default: -Xmx2g -Xms512m)
  JOBSTREAM_KAFKA_START_TIMEOUT      seconds to wait for the broker (default: 60)
  JOBSTREAM_RELAY                    python (default) or debezium: with debezium, `up`/`down`
                                     also manage the Kafka Connect worker
  JOBSTREAM_CONNECT_PORT             Connect REST port    (default: 8083)
  JOBSTREAM_CONNECT_GROUP            Connect group.id; its config/offset/status topics are
                                     <group>-configs|-offsets|-status (default: jobstream-connect)
  JOBSTREAM_CONNECT_DIR              worker state (config, logs, pid) (default: $JOBSTREAM_HOME/connect)
  JOBSTREAM_CONNECT_HEAP_OPTS        worker heap          (default: -Xmx768m -Xms256m)
  JOBSTREAM_CONNECT_START_TIMEOUT    seconds to wait for the worker's REST API (default: 120)

Layout
  $JOBSTREAM_HOME/kafka/{libs,config,data,logs,kafka.pid,cluster.id}
  $JOBSTREAM_HOME/pg/{data,run,log}
  $JOBSTREAM_HOME/connect/libs       Connect + Debezium jars (scripts/connect-pom.xml)
  $JOBSTREAM_CONNECT_DIR/{config,logs,connect.pid}

Requires Debian (apt-get) and root only when something must be installed;
Java 17+, Maven and PostgreSQL are installed via apt only if missing.
EOF
}

# ----------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------
SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
REPO_ROOT=$(cd -- "$SCRIPT_DIR/.." && pwd -P)

JOBSTREAM_HOME=${JOBSTREAM_HOME:-$REPO_ROOT/.local}
case $JOBSTREAM_HOME in /*) ;; *) JOBSTREAM_HOME=$PWD/$JOBSTREAM_HOME ;; esac

KAFKA_PORT=${JOBSTREAM_KAFKA_PORT:-9092}
KAFKA_CONTROLLER_PORT=${JOBSTREAM_KAFKA_CONTROLLER_PORT:-9093}
PG_PORT=${JOBSTREAM_PG_PORT:-55432}
KAFKA_HEAP_OPTS=${JOBSTREAM_KAFKA_HEAP_OPTS:--Xmx2g -Xms512m}
KAFKA_START_TIMEOUT=${JOBSTREAM_KAFKA_START_TIMEOUT:-60}

LOCAL_BOOTSTRAP=127.0.0.1:$KAFKA_PORT
LOCAL_DB_URL=postgresql://jobstream:jobstream@127.0.0.1:$PG_PORT/jobstream
BOOTSTRAP=${JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS:-${KAFKA_BOOTSTRAP_SERVERS:-$LOCAL_BOOTSTRAP}}
DB_URL=${JOBSTREAM_DATABASE_URL:-${DATABASE_URL:-$LOCAL_DB_URL}}

KAFKA_POM=$SCRIPT_DIR/kafka-pom.xml
KAFKA_LOG4J_SRC=$SCRIPT_DIR/kafka-log4j2.properties
KAFKA_DIR=$JOBSTREAM_HOME/kafka
KAFKA_LIBS=$KAFKA_DIR/libs
KAFKA_STAMP=$KAFKA_LIBS/.pom.sha256
KAFKA_CONF_DIR=$KAFKA_DIR/config
KAFKA_CONF=$KAFKA_CONF_DIR/server.properties
KAFKA_LOG4J=$KAFKA_CONF_DIR/log4j2.properties
KAFKA_TOOLS_LOG4J=$KAFKA_CONF_DIR/tools-log4j2.properties
KAFKA_DATA=$KAFKA_DIR/data
KAFKA_LOGS=$KAFKA_DIR/logs
KAFKA_PID=$KAFKA_DIR/kafka.pid
KAFKA_CLUSTER_ID_FILE=$KAFKA_DIR/cluster.id
KAFKA_OUT=$KAFKA_LOGS/kafka.out

RELAY=${JOBSTREAM_RELAY:-python}
CONNECT_PORT=${JOBSTREAM_CONNECT_PORT:-8083}
CONNECT_GROUP=${JOBSTREAM_CONNECT_GROUP:-jobstream-connect}
CONNECT_HEAP_OPTS=${JOBSTREAM_CONNECT_HEAP_OPTS:--Xmx768m -Xms256m}
CONNECT_START_TIMEOUT=${JOBSTREAM_CONNECT_START_TIMEOUT:-120}
CONNECT_POM=$SCRIPT_DIR/connect-pom.xml
CONNECT_LIBS=$JOBSTREAM_HOME/connect/libs
CONNECT_DIR=${JOBSTREAM_CONNECT_DIR:-$JOBSTREAM_HOME/connect}
case $CONNECT_DIR in /*) ;; *) CONNECT_DIR=$PWD/$CONNECT_DIR ;; esac
CONNECT_CONF=$CONNECT_DIR/config/connect-distributed.properties
CONNECT_LOG4J=$CONNECT_DIR/config/log4j2.properties
CONNECT_LOGS=$CONNECT_DIR/logs
CONNECT_PID=$CONNECT_DIR/connect.pid
CONNECT_OUT=$CONNECT_LOGS/connect.out
CONNECT_URL=http://127.0.0.1:$CONNECT_PORT

PG_DIR=$JOBSTREAM_HOME/pg
PG_DATA=$PG_DIR/data
PG_RUN=$PG_DIR/run
PG_LOGDIR=$PG_DIR/log
PG_LOG=$PG_LOGDIR/postgres.log
PG_OS_USER=postgres      # OS user owning the cluster when we run as root
PG_SUPERUSER=postgres    # bootstrap superuser created by initdb (-U)

# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------
log()  { printf '[services] %s\n' "$*" >&2; }
warn() { printf '[services] WARNING: %s\n' "$*" >&2; }
die()  { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }

is_root() { [[ $(id -u) -eq 0 ]]; }

# Print the last lines of a log file to stderr (used on failures).
show_tail() {
  local file=$1 n=${2:-40}
  if [[ -s $file ]]; then
    printf '[services] ---- last %s lines of %s ----\n' "$n" "$file" >&2
    tail -n "$n" "$file" | sed 's/^/[services] | /' >&2
    printf '[services] ---- end of %s ----\n' "$file" >&2
  else
    printf '[services] (%s is missing or empty)\n' "$file" >&2
  fi
}

check_port() {
  local name=$1 value=$2
  if ! [[ $value =~ ^[0-9]+$ ]] || ((value < 1 || value > 65535)); then
    die "$name must be a TCP port number, got '$value'"
  fi
}

APT_UPDATED=0
apt_install() {
  command -v apt-get >/dev/null 2>&1 \
    || die "need to install $* but apt-get is not available (this script targets Debian 12)"
  is_root || die "need to install $* via apt-get, which requires root (re-run as root or install them yourself)"
  export DEBIAN_FRONTEND=noninteractive
  if ((APT_UPDATED == 0)); then
    log "apt-get update"
    apt-get update -q >&2 || die "apt-get update failed"
    APT_UPDATED=1
  fi
  log "apt-get install -y $*"
  # Slim Debian images lack the man dirs; the JRE's update-alternatives needs them.
  mkdir -p /usr/share/man/man1
  apt-get install -y -q --no-install-recommends "$@" >&2 || die "apt-get install $* failed"
}

# Alive and not a zombie (an exited child that init has not reaped yet; some
# container inits reap lazily, and kill -0 still succeeds on zombies).
pid_alive() {
  local st
  kill -0 "$1" 2>/dev/null || return 1
  st=$(sed -E 's/^.*\) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || true
  [[ $st != Z ]]
}

# Current time in seconds (integer), for timings.
now() { date +%s; }

# Split "a:1,b:2" / "PLAINTEXT://a:1" into "host port" lines.
bootstrap_hostports() {
  local item hp
  local -a items
  IFS=',' read -r -a items <<<"$1"
  for item in "${items[@]}"; do
    item=${item//[[:space:]]/}
    [[ -n $item ]] || continue
    hp=${item##*://}
    [[ $hp == *:* ]] || continue
    printf '%s %s\n' "${hp%:*}" "${hp##*:}"
  done
}

# ----------------------------------------------------------------------------
# Kafka
# ----------------------------------------------------------------------------

# Does host:port speak the Kafka protocol? Sends an ApiVersions v0 request over
# bash's /dev/tcp and checks correlation id + error code of the answer. Cheap
# (no JVM) and bounded by `timeout`. A KRaft broker only starts processing
# requests once it is registered and unfenced, so an answer means "ready".
kafka_ping() {
  local host=$1 port=$2 out
  # Request: size=18 | api_key=18 (ApiVersions) | version=0 | correlation=0x4A53 | client_id="services"
  out=$(timeout 5 bash -c '
      exec 3<>"/dev/tcp/$0/$1" || exit 1
      printf "\x00\x00\x00\x12\x00\x12\x00\x00\x00\x00\x4a\x53\x00\x08services" >&3
      head -c 10 <&3 | od -An -tx1
    ' "$host" "$port" 2>/dev/null) || return 1
  out=$(tr -s ' \n' ' ' <<<"$out")
  # bytes 4..7 = correlation id 00 00 4a 53, bytes 8..9 = error code 00 00
  [[ $out =~ ^\ ?[0-9a-f]{2}\ [0-9a-f]{2}\ [0-9a-f]{2}\ [0-9a-f]{2}\ 00\ 00\ 4a\ 53\ 00\ 00 ]]
}

# Is anything listening on host:port (TCP connect only)?
tcp_open() {
  timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

# True if any server in the bootstrap list answers the Kafka protocol.
kafka_answers() {
  local host port
  while read -r host port; do
    kafka_ping "$host" "$port" && return 0
  done < <(bootstrap_hostports "$1")
  return 1
}

# is_our_jvm <pid> <command-line text>: a live JVM whose command line holds that text
# (its main class and our config file: guards against pid reuse).
is_our_jvm() {
  pid_alive "$1" || return 1
  tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF "$2"
}

# our_jvm_pid <pid file> <command-line text>: pid of the JVM this script started,
# if it is still alive. Uses the pid file (guarding against pid reuse) and falls
# back to scanning /proc in case the pid file was lost (then rewrites it).
our_jvm_pid() {
  local pidfile=$1 text=$2 pid f
  if [[ -f $pidfile ]]; then
    pid=$(tr -dc '0-9' <"$pidfile")
    if [[ -n $pid ]] && is_our_jvm "$pid" "$text"; then
      printf '%s\n' "$pid"
      return 0
    fi
  fi
  for f in /proc/[0-9]*/cmdline; do
    pid=${f#/proc/}
    pid=${pid%/cmdline}
    if is_our_jvm "$pid" "$text"; then
      printf '%s\n' "$pid" >"$pidfile" 2>/dev/null || true
      printf '%s\n' "$pid"
      return 0
    fi
  done
  return 1
}

# fetch_jars <label> <pom> <libs dir> <jar glob that must land> [hint on failure]:
# `mvn dependency:copy-dependencies` of the pom into the libs dir, unless the
# pom's sha256 (stamped in <libs>/.pom.sha256) is unchanged and the jar is there.
fetch_jars() {
  local label=$1 pom=$2 libs=$3 marker=$4 what=${5:-jars} want have="" stamp
  stamp=$libs/.pom.sha256
  [[ -f $pom ]] || die "missing $pom"
  want=$(sha256sum "$pom" | cut -d' ' -f1)
  [[ -f $stamp ]] && have=$(<"$stamp")
  if [[ $want == "$have" ]] && compgen -G "$libs/$marker" >/dev/null; then
    return 0
  fi
  if [[ -d $libs ]]; then
    log "$label: $pom changed (or libs incomplete); re-fetching jars"
  fi
  if ! command -v mvn >/dev/null 2>&1; then
    log "mvn not found; installing maven"
    apt_install maven
  fi
  local tmp=$libs.tmp.$$ mvnlog t0
  mvnlog=$(dirname "$libs")/mvn.log
  rm -rf "$tmp"
  mkdir -p "$tmp"
  log "$label: fetching $what from Maven Central (mvn dependency:copy-dependencies) ..."
  t0=$(now)
  # Full plugin coordinates (same version as the pom's pluginManagement): no
  # plugin-prefix metadata lookup, works offline once cached in ~/.m2.
  if ! mvn -q -B -Dstyle.color=never -f "$pom" \
        org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$tmp" >"$mvnlog" 2>&1; then
    show_tail "$mvnlog" 60
    rm -rf "$tmp"
    if grep -q 'PKIX path building failed' "$mvnlog"; then
      warn "Java does not trust the TLS certificate presented for Maven Central (intercepting proxy?); add its CA to /usr/local/share/ca-certificates and run update-ca-certificates"
    fi
    die "$label: maven could not fetch the $what (log: $mvnlog)"
  fi
  compgen -G "$tmp/$marker" >/dev/null \
    || die "$label: maven ran but no $marker landed in $tmp"
  printf '%s\n' "$want" >"$tmp/.pom.sha256"
  rm -rf "$libs"
  mv "$tmp" "$libs"
  log "$label: $(find "$libs" -name '*.jar' | wc -l) jars in $libs ($(($(now) - t0))s)"
}

# spawn_jvm <label> <pid file> <work dir> <stdout file> <command...>: start the
# command detached (setsid, nohup). The child writes its own pid, then execs the
# JVM (so the pid stays valid whether or not setsid forks). fd 9 (our lock) must
# not leak into it. Waits up to 5 s for the pid file.
spawn_jvm() {
  local label=$1 pidfile=$2 dir=$3 out=$4 i
  shift 4
  : >"$out"
  rm -f "$pidfile"
  nohup setsid bash -c 'echo $$ >"$0"; cd "$1" && shift && exec "$@"' \
    "$pidfile" "$dir" "$@" </dev/null >>"$out" 2>&1 9>&- &
  for ((i = 0; i < 50; i++)); do
    [[ -s $pidfile ]] && return 0
    sleep 0.1
  done
  die "$label: process did not start (no pid file $pidfile)"
}

# stop_pid <label> <pid> <immediate 0|1> <noun>: SIGTERM (or SIGKILL when
# immediate), wait up to 30 s, then SIGKILL and wait up to 5 s more.
stop_pid() {
  local label=$1 pid=$2 immediate=$3 noun=$4 i
  if ((immediate)); then
    log "$label: killing $noun pid $pid (SIGKILL, --immediate)"
    kill -KILL "$pid" 2>/dev/null || true
  else
    log "$label: stopping $noun pid $pid (SIGTERM)"
    kill -TERM "$pid" 2>/dev/null || true
  fi
  for ((i = 0; i < 300; i++)); do
    pid_alive "$pid" || break
    sleep 0.1
  done
  if pid_alive "$pid"; then
    warn "$label: $noun pid $pid still alive after 30s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      pid_alive "$pid" || break
      sleep 0.1
    done
  fi
}

# Pid of the broker this script started, if it is still alive.
kafka_our_pid() { our_jvm_pid "$KAFKA_PID" "kafka.Kafka $KAFKA_CONF"; }

JAVA=
java_major() {
  local v
  v=$("$1" -version 2>&1 | awk -F'"' '/version/ {print $2; exit}') || return 1
  [[ -n $v ]] || return 1
  if [[ $v == 1.* ]]; then v=${v#1.}; fi
  printf '%s\n' "${v%%[.+-]*}"
}

find_java17() {
  local c m
  local -a cands=()
  [[ -n ${JAVA_HOME:-} ]] && cands+=("$JAVA_HOME/bin/java")
  command -v java >/dev/null 2>&1 && cands+=("$(command -v java)")
  cands+=(/usr/lib/jvm/java-*-openjdk-*/bin/java)
  for c in "${cands[@]}"; do
    [[ -x $c ]] || continue
    m=$(java_major "$c" 2>/dev/null) || continue
    [[ $m =~ ^[0-9]+$ ]] && ((m >= 17)) && { printf '%s\n' "$c"; return 0; }
  done
  return 1
}

ensure_java() {
  [[ -n $JAVA ]] && return 0
  if ! JAVA=$(find_java17); then
    local pkgs=(openjdk-17-jre-headless)
    # Fresh machine: maven will be needed right after; one apt run for both.
    if ! command -v mvn >/dev/null 2>&1 && [[ ! -f $KAFKA_STAMP ]]; then pkgs+=(maven); fi
    log "no Java >= 17 found (Kafka 4 needs it); installing ${pkgs[*]}"
    apt_install "${pkgs[@]}"
    JAVA=$(find_java17) || die "Java 17 still not found after installing openjdk-17-jre-headless"
  fi
}

ensure_kafka_libs() { fetch_jars kafka "$KAFKA_POM" "$KAFKA_LIBS" "kafka_2.13-*.jar" "Kafka jars"; }

write_kafka_config() {
  mkdir -p "$KAFKA_CONF_DIR" "$KAFKA_DATA" "$KAFKA_LOGS"
  [[ -f $KAFKA_LOG4J_SRC ]] || die "missing $KAFKA_LOG4J_SRC"
  cp "$KAFKA_LOG4J_SRC" "$KAFKA_LOG4J"
  cat >"$KAFKA_TOOLS_LOG4J" <<'EOF'
# log4j2 config for the short-lived Kafka CLI tools run by services.sh
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = STDERR
appender.stderr.type = Console
appender.stderr.name = STDERR
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = [%d] %p %m (%c)%n
EOF
  cat >"$KAFKA_CONF" <<EOF
# Generated by scripts/services.sh -- rewritten on every 'up'; edit the script instead.
# Single-node KRaft: this process is both broker and controller.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT

log.dirs=$KAFKA_DATA
num.partitions=3
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=false

offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0

num.network.threads=3
num.io.threads=8
log.retention.hours=168
log.segment.bytes=1073741824
log.retention.check.interval.ms=300000
EOF
}

kafka_tool() { # kafka_tool <main-class> args...
  "$JAVA" -Xmx256m -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$KAFKA_TOOLS_LOG4J" -cp "$KAFKA_LIBS/*" "$@"
}

format_kafka_storage() {
  if [[ -f $KAFKA_DATA/meta.properties ]]; then
    return 0
  fi
  local cid fmtlog=$KAFKA_LOGS/format.log
  if [[ -s $KAFKA_CLUSTER_ID_FILE ]]; then
    cid=$(<"$KAFKA_CLUSTER_ID_FILE")
  else
    cid=$(kafka_tool kafka.tools.StorageTool random-uuid 2>"$fmtlog" | tail -n1) \
      || { show_tail "$fmtlog"; die "kafka: could not generate a cluster id"; }
    [[ -n $cid ]] || die "kafka: StorageTool random-uuid printed nothing"
    printf '%s\n' "$cid" >"$KAFKA_CLUSTER_ID_FILE"
  fi
  log "kafka: formatting $KAFKA_DATA (cluster id $cid, --standalone)"
  if ! kafka_tool kafka.tools.StorageTool format --standalone -t "$cid" -c "$KAFKA_CONF" >"$fmtlog" 2>&1; then
    show_tail "$fmtlog"
    die "kafka: storage format failed (log: $fmtlog)"
  fi
}

# server.log is appended across runs; on failure show only this run's lines.
KAFKA_LOG_MARK=0
show_kafka_log() {
  local f=$KAFKA_LOGS/server.log n=${1:-60}
  if [[ -s $f ]] && ((KAFKA_LOG_MARK > 0)); then
    tail -n +"$((KAFKA_LOG_MARK + 1))" "$f" >"$KAFKA_LOGS/server.log.this-run"
    show_tail "$KAFKA_LOGS/server.log.this-run" "$n"
    rm -f "$KAFKA_LOGS/server.log.this-run"
  else
    show_tail "$f" "$n"
  fi
}

start_kafka_process() {
  KAFKA_LOG_MARK=0
  [[ -f $KAFKA_LOGS/server.log ]] && KAFKA_LOG_MARK=$(wc -l <"$KAFKA_LOGS/server.log")
  # shellcheck disable=SC2086  # KAFKA_HEAP_OPTS is a word list on purpose
  spawn_jvm kafka "$KAFKA_PID" "$KAFKA_DIR" "$KAFKA_OUT" \
    "$JAVA" $KAFKA_HEAP_OPTS -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true \
    -Dkafka.logs.dir="$KAFKA_LOGS" -Dlog4j2.configurationFile="$KAFKA_LOG4J" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$KAFKA_CONF"
}

# Wait until our broker answers ApiVersions and a metadata request (topic list).
wait_for_kafka() {
  local pid=$1 t0=$2 deadline host port
  deadline=$((t0 + KAFKA_START_TIMEOUT))
  read -r host port < <(bootstrap_hostports "$LOCAL_BOOTSTRAP")
  while :; do
    if ! pid_alive "$pid"; then
      show_kafka_log 60
      show_tail "$KAFKA_OUT" 20
      die "kafka: broker process $pid exited during startup"
    fi
    if kafka_ping "$host" "$port"; then
      break
    fi
    if (($(now) >= deadline)); then
      show_kafka_log 60
      show_tail "$KAFKA_OUT" 20
      die "kafka: broker did not answer on $LOCAL_BOOTSTRAP within ${KAFKA_START_TIMEOUT}s (pid $pid still running; stop it with '$0 down')"
    fi
    sleep 0.5
  done
  # Final end-to-end check through the real Kafka admin client.
  local remaining=$((deadline - $(now)))
  ((remaining < 15)) && remaining=15
  if ! timeout "$remaining" "$JAVA" -Xmx256m -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$KAFKA_TOOLS_LOG4J" -cp "$KAFKA_LIBS/*" \
        org.apache.kafka.tools.TopicCommand --bootstrap-server "$LOCAL_BOOTSTRAP" --list \
        >"$KAFKA_LOGS/ready-check.log" 2>&1; then
    show_tail "$KAFKA_LOGS/ready-check.log" 20
    show_kafka_log 40
    die "kafka: broker answers ApiVersions but a metadata request (TopicCommand --list) failed"
  fi
}

KAFKA_RESULT=
up_kafka() {
  check_port JOBSTREAM_KAFKA_PORT "$KAFKA_PORT"
  check_port JOBSTREAM_KAFKA_CONTROLLER_PORT "$KAFKA_CONTROLLER_PORT"

  if kafka_answers "$BOOTSTRAP"; then
    KAFKA_RESULT="$BOOTSTRAP (already running)"
    return 0
  fi
  if [[ $BOOTSTRAP != "$LOCAL_BOOTSTRAP" ]]; then
    warn "kafka: configured bootstrap '$BOOTSTRAP' does not answer; using a local broker on $LOCAL_BOOTSTRAP"
    if kafka_answers "$LOCAL_BOOTSTRAP"; then
      KAFKA_RESULT="$LOCAL_BOOTSTRAP (already running)"
      return 0
    fi
  fi

  local pid t0
  t0=$(now)
  ensure_java
  if pid=$(kafka_our_pid); then
    # Our broker is alive but not answering yet (still starting?): wait for it.
    log "kafka: broker pid $pid is running but not answering yet; waiting up to ${KAFKA_START_TIMEOUT}s"
    wait_for_kafka "$pid" "$t0"
    KAFKA_RESULT="$LOCAL_BOOTSTRAP (already running)"
    return 0
  fi
  if [[ -f $KAFKA_PID ]]; then
    log "kafka: removing stale pid file $KAFKA_PID"
    rm -f "$KAFKA_PID"
  fi
  local p
  for p in "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT"; do
    if tcp_open 127.0.0.1 "$p"; then
      die "kafka: port 127.0.0.1:$p is already in use by something that is not a Kafka broker this script manages (try JOBSTREAM_KAFKA_PORT / JOBSTREAM_KAFKA_CONTROLLER_PORT); see: ss -ltnp"
    fi
  done

  mkdir -p "$KAFKA_DIR" "$KAFKA_LOGS"
  ensure_kafka_libs
  write_kafka_config
  format_kafka_storage

  log "kafka: starting broker on $LOCAL_BOOTSTRAP (controller 127.0.0.1:$KAFKA_CONTROLLER_PORT, logs $KAFKA_LOGS/server.log)"
  t0=$(now)
  start_kafka_process
  pid=$(<"$KAFKA_PID")
  wait_for_kafka "$pid" "$t0"
  log "kafka: ready after $(($(now) - t0))s (pid $pid)"
  KAFKA_RESULT="$LOCAL_BOOTSTRAP (started)"
}

# down_kafka [immediate]: SIGTERM (controlled shutdown), or SIGKILL to simulate a crash.
down_kafka() {
  local pid immediate=${1:-0}
  if ! pid=$(kafka_our_pid); then
    rm -f "$KAFKA_PID"
    if kafka_answers "$BOOTSTRAP"; then
      echo "kafka: not started by this script; left running at $BOOTSTRAP"
    else
      echo "kafka: not running"
    fi
    return 0
  fi
  stop_pid kafka "$pid" "$immediate" broker
  rm -f "$KAFKA_PID"
  echo "kafka: stopped (pid $pid)"
}

# ----------------------------------------------------------------------------
# Kafka Connect (distributed mode) + Debezium: only with JOBSTREAM_RELAY=debezium
# or an explicit `connect` service argument, so the default path stays as fast.
# ----------------------------------------------------------------------------

# Does the worker's REST API answer GET /connectors with 200 (the herder has
# joined its group and read the config topic)?
connect_answers() {
  local code
  code=$(curl -s -o /dev/null -m 5 -w '%{http_code}' "$CONNECT_URL/connectors" 2>/dev/null) || return 1
  [[ $code == 200 ]]
}

connect_our_pid() { our_jvm_pid "$CONNECT_PID" "ConnectDistributed $CONNECT_CONF"; }

ensure_connect_libs() {
  fetch_jars connect "$CONNECT_POM" "$CONNECT_LIBS" "debezium-connect-plugins-*.jar" \
    "Kafka Connect + Debezium jars"
}

write_connect_config() {
  mkdir -p "$(dirname "$CONNECT_CONF")" "$CONNECT_LOGS"
  cat >"$CONNECT_LOG4J" <<'L4J'
# log4j2 config of the Kafka Connect worker started by services.sh (rewritten on every start)
status = warn
property.logdir = ${sys:connect.logs.dir:-logs}
appender.file.type = RollingFile
appender.file.name = FILE
appender.file.fileName = ${logdir}/connect.log
appender.file.filePattern = ${logdir}/connect.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = info
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = org.apache.kafka
logger.kafka.level = warn
logger.runtime.name = org.apache.kafka.connect.runtime
logger.runtime.level = info
logger.reflections.name = org.reflections
logger.reflections.level = error
L4J
  cat >"$CONNECT_CONF" <<CONF
# Generated by scripts/services.sh -- rewritten on every start; edit the script instead.
# Kafka Connect in DISTRIBUTED mode: the connector config, source offsets (the LSN Debezium
# confirmed) and task status live in three compacted Kafka topics, so a worker that dies
# (kill -9) resumes from the last committed offset on restart or on another worker.
bootstrap.servers=$BOOTSTRAP
group.id=$CONNECT_GROUP
config.storage.topic=$CONNECT_GROUP-configs
offset.storage.topic=$CONNECT_GROUP-offsets
status.storage.topic=$CONNECT_GROUP-status
# Created by the worker with cleanup.policy=compact; one broker here (RF 1). Production: RF 3.
config.storage.replication.factor=1
offset.storage.replication.factor=1
status.storage.replication.factor=1
offset.storage.partitions=5
status.storage.partitions=1
# How often source offsets are committed (default 60 s); Debezium confirms the LSN to Postgres
# (so the replication slot releases WAL) after that commit; a crash re-sends up to ~1 s.
offset.flush.interval.ms=1000
offset.flush.timeout.ms=10000
key.converter=org.apache.kafka.connect.storage.StringConverter
value.converter=org.apache.kafka.connect.converters.ByteArrayConverter
header.converter=org.apache.kafka.connect.storage.StringConverter
listeners=http://127.0.0.1:$CONNECT_PORT
rest.advertised.host.name=127.0.0.1
rest.advertised.port=$CONNECT_PORT
# The connector asks for an idempotent producer (acks=all), as the Python relay's.
connector.client.config.override.policy=All
# A dead worker's tasks are reassigned after 5 s, not Connect's default 5 min (docs/relays.md).
scheduled.rebalance.max.delay.ms=5000
# Plugins are on the worker's classpath (scripts/connect-pom.xml); no plugin.path scan.
plugin.discovery=only_scan
CONF
}

start_connect_process() {
  # shellcheck disable=SC2086  # CONNECT_HEAP_OPTS is a word list on purpose
  spawn_jvm connect "$CONNECT_PID" "$CONNECT_DIR" "$CONNECT_OUT" \
    "$JAVA" $CONNECT_HEAP_OPTS -XX:+UseG1GC -XX:+ExitOnOutOfMemoryError \
    -Djava.awt.headless=true \
    -Dconnect.logs.dir="$CONNECT_LOGS" -Dlog4j2.configurationFile="$CONNECT_LOG4J" \
    -cp "$CONNECT_LIBS/*" org.apache.kafka.connect.cli.ConnectDistributed "$CONNECT_CONF"
}

wait_for_connect() {
  local pid=$1 t0=$2 deadline
  deadline=$((t0 + CONNECT_START_TIMEOUT))
  while ! connect_answers; do
    if ! pid_alive "$pid"; then
      show_tail "$CONNECT_LOGS/connect.log" 60
      show_tail "$CONNECT_OUT" 20
      die "connect: worker process $pid exited during startup"
    fi
    if (($(now) >= deadline)); then
      show_tail "$CONNECT_LOGS/connect.log" 60
      die "connect: worker REST API $CONNECT_URL did not answer within ${CONNECT_START_TIMEOUT}s (pid $pid still running)"
    fi
    sleep 0.5
  done
}

CONNECT_RESULT=
up_connect() {
  check_port JOBSTREAM_CONNECT_PORT "$CONNECT_PORT"
  if connect_answers; then
    CONNECT_RESULT="$CONNECT_URL (already running)"
    return 0
  fi
  kafka_answers "$BOOTSTRAP" || die "connect: Kafka does not answer at $BOOTSTRAP (start it first)"
  local pid t0
  t0=$(now)
  ensure_java
  if pid=$(connect_our_pid); then
    log "connect: worker pid $pid is running but not answering yet; waiting"
    wait_for_connect "$pid" "$t0"
    CONNECT_RESULT="$CONNECT_URL (already running)"
    return 0
  fi
  if tcp_open 127.0.0.1 "$CONNECT_PORT"; then
    die "connect: port 127.0.0.1:$CONNECT_PORT is in use by something that is not a Connect worker this script manages (set JOBSTREAM_CONNECT_PORT)"
  fi
  mkdir -p "$CONNECT_DIR" "$CONNECT_LOGS"
  ensure_connect_libs
  write_connect_config
  log "connect: starting worker (group $CONNECT_GROUP, REST $CONNECT_URL, logs $CONNECT_LOGS/connect.log)"
  # The start timeout is the JVM's: a first run's jar download (~90 s at load) used to count
  # against it, and the Debezium module's fixture failed in a fresh clone (as kafka's t0 above).
  t0=$(now)
  start_connect_process
  pid=$(<"$CONNECT_PID")
  wait_for_connect "$pid" "$t0"
  log "connect: ready after $(($(now) - t0))s (pid $pid)"
  CONNECT_RESULT="$CONNECT_URL (started)"
}

# down_connect [immediate]: SIGTERM (clean: commits offsets, stops tasks), or SIGKILL (a crash).
down_connect() {
  local pid immediate=${1:-0}
  if ! pid=$(connect_our_pid); then
    rm -f "$CONNECT_PID"
    if connect_answers; then
      echo "connect: not started by this script; left running at $CONNECT_URL"
    else
      echo "connect: not running"
    fi
    return 0
  fi
  stop_pid connect "$pid" "$immediate" worker
  rm -f "$CONNECT_PID"
  echo "connect: stopped (pid $pid)"
}

# ----------------------------------------------------------------------------
# PostgreSQL
# ----------------------------------------------------------------------------
PG_BIN=
find_pg_bin() {
  local v c
  if [[ -f $PG_DATA/PG_VERSION ]]; then
    v=$(<"$PG_DATA/PG_VERSION")
    if [[ -x /usr/lib/postgresql/$v/bin/initdb ]]; then
      printf '%s\n' "/usr/lib/postgresql/$v/bin"
      return 0
    fi
    die "postgres: $PG_DATA was created by PostgreSQL $v but /usr/lib/postgresql/$v/bin is missing (install postgresql-$v or delete $PG_DIR)"
  fi
  c=$(compgen -G '/usr/lib/postgresql/*/bin/initdb' | sort -V | tail -n1) || true
  [[ -n $c ]] || return 1
  dirname "$c"
}

ensure_pg_packages() {
  if ! PG_BIN=$(find_pg_bin); then
    log "postgres: PostgreSQL server not installed; installing Debian's postgresql"
    apt_install postgresql
    PG_BIN=$(find_pg_bin) || die "postgres: initdb still missing after installing postgresql"
  fi
  command -v psql >/dev/null 2>&1 || apt_install postgresql-client
}

# Run a command as the OS user owning the cluster (postgres when we are root;
# initdb/postgres refuse to run as root). cd / so an unreadable cwd is harmless.
as_pg() {
  if is_root; then
    (cd / && runuser -u "$PG_OS_USER" -- "$@")
  else
    (cd / && "$@")
  fi
}

pg_answers() { # URL
  command -v psql >/dev/null 2>&1 || return 1
  local out
  out=$(PGCONNECT_TIMEOUT=3 timeout 10 psql "$1" -XAtqc 'select 1' 2>/dev/null) || return 1
  [[ $out == 1 ]]
}

pg_running() { # our cluster's postmaster alive?
  [[ -f $PG_DATA/PG_VERSION ]] || return 1
  local pid i
  pid=$(sed -n 1p "$PG_DATA/postmaster.pid" 2>/dev/null | tr -dc '0-9') || true
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && ! pid_alive "$pid"; then
    # The postmaster died (e.g. kill -9) but is still an unreaped zombie:
    # pg_ctl would call it running and a new postmaster would refuse the
    # lock file. Wait (bounded) for init to reap it.
    log "postgres: postmaster pid $pid is dead but not yet reaped; waiting for it"
    for ((i = 0; i < 150; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    return 1
  fi
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1
}

pg_admin_psql() { # psql as the bootstrap superuser over our unix socket
  PGCONNECT_TIMEOUT=5 psql -X -q -v ON_ERROR_STOP=1 -h "$PG_RUN" -p "$PG_PORT" -U "$PG_SUPERUSER" -d postgres
}

prepare_pg_dirs() {
  mkdir -p "$PG_DATA" "$PG_RUN" "$PG_LOGDIR"
  if is_root; then
    getent passwd "$PG_OS_USER" >/dev/null || die "postgres: OS user '$PG_OS_USER' does not exist (is the postgresql package installed?)"
    chown -R "$PG_OS_USER:" "$PG_DIR"
    if ! runuser -u "$PG_OS_USER" -- test -w "$PG_DATA"; then
      local d=$PG_DIR blocked=
      while [[ $d != / ]]; do
        d=$(dirname "$d")
        runuser -u "$PG_OS_USER" -- test -x "$d" || blocked=$d
      done
      die "postgres: OS user '$PG_OS_USER' cannot reach $PG_DATA${blocked:+ ($blocked is not traversable for it)}; point JOBSTREAM_HOME at a directory it can reach (e.g. JOBSTREAM_HOME=/var/tmp/jobstream) or run: chmod o+x $blocked"
    fi
  fi
  chmod 700 "$PG_DATA"
  chmod 755 "$PG_RUN"
  # Unix socket paths are limited to ~107 bytes.
  local sock="$PG_RUN/.s.PGSQL.$PG_PORT"
  ((${#sock} < 100)) || die "postgres: socket path $sock is too long for a unix socket; use a shorter JOBSTREAM_HOME"
}

init_pg_cluster() {
  [[ -f $PG_DATA/PG_VERSION ]] && return 0
  if [[ -n $(ls -A "$PG_DATA") ]]; then
    die "postgres: $PG_DATA is not empty but has no PG_VERSION; move it away or delete $PG_DIR"
  fi
  local locale_opt=(--no-locale)
  if locale -a 2>/dev/null | grep -qix 'C\.utf-\?8'; then locale_opt=(--locale=C.UTF-8); fi
  log "postgres: initdb $PG_DATA ($("$PG_BIN/postgres" --version))"
  if ! as_pg "$PG_BIN/initdb" -D "$PG_DATA" -U "$PG_SUPERUSER" --auth=trust \
        --encoding=UTF8 "${locale_opt[@]}" >"$PG_LOGDIR/initdb.log" 2>&1; then
    show_tail "$PG_LOGDIR/initdb.log"
    die "postgres: initdb failed (log: $PG_LOGDIR/initdb.log)"
  fi
  printf "\n# Added by scripts/services.sh\ninclude_if_exists = 'jobstream.conf'\n" >>"$PG_DATA/postgresql.conf"
}

# Writes jobstream.conf; returns 0 if it changed.
write_pg_config() {
  local conf=$PG_DATA/jobstream.conf new
  new=$(cat <<EOF
# Generated by scripts/services.sh -- rewritten on every 'up'.
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_RUN'
max_connections = 300
shared_buffers = 128MB
# logical decoding for the Debezium relay (JOBSTREAM_RELAY=debezium); harmless for the Python relay
wal_level = logical
max_replication_slots = 10
max_wal_senders = 10
# WAL per job (bench/README.md, perf-pg9): the first change of a page after a checkpoint logs the
# whole 8 KB page; lz4 compresses those page images (2.1 -> 0.9 MB for a checkpoint in the middle
# of a 600-job burst), and checkpoints every 15 min / 4 GB instead of 5 min / 1 GB log them 3-4x
# less often at the pipeline's rate (~3.6 MB of WAL per second). Crash recovery replays up to the
# WAL since the last checkpoint: longer, never less safe (fsync and synchronous_commit unchanged).
wal_compression = lz4
checkpoint_timeout = 15min
max_wal_size = 4GB
log_line_prefix = '%m [%p] %q%u@%d '
log_timezone = 'UTC'
timezone = 'UTC'
EOF
)
  if [[ -f $conf && $(<"$conf") == "$new" ]]; then
    return 1
  fi
  printf '%s\n' "$new" >"$conf"
  is_root && chown "$PG_OS_USER:" "$conf"
  return 0
}

ensure_pg_role_db() {
  pg_admin_psql <<'SQL' >/dev/null
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'jobstream') THEN
    CREATE ROLE jobstream LOGIN SUPERUSER PASSWORD 'jobstream';
  END IF;
END
$$;
SELECT 'CREATE DATABASE jobstream OWNER jobstream'
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'jobstream')\gexec
SQL
}

# A running cluster of ours whose generated settings changed (a newer checkout) gets them by a
# reload, not a restart: nothing running against it is cut off. Settings that need a restart
# (max_connections, shared_buffers, wal_level...) wait for `restart postgres`; Postgres says
# so in pg_settings.pending_restart.
reload_pg_config_if_ours() {
  local bin
  [[ -f $PG_DATA/PG_VERSION ]] && bin=$(find_pg_bin) && PG_BIN=$bin && pg_running || return 0
  write_pg_config || return 0
  log "postgres: configuration changed; reloading the running cluster (settings that need a restart wait for: scripts/services.sh restart postgres)"
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" reload >/dev/null 2>&1 9>&- \
    || warn "postgres: pg_ctl reload failed; the new settings apply at the next restart"
  PG_RESULT="$DB_URL (already running, configuration reloaded)"
}

PG_RESULT=
up_pg() {
  check_port JOBSTREAM_PG_PORT "$PG_PORT"
  if pg_answers "$DB_URL"; then
    PG_RESULT="$DB_URL (already running)"
    reload_pg_config_if_ours
    return 0
  fi
  ensure_pg_packages
  if [[ $DB_URL != "$LOCAL_DB_URL" ]]; then
    warn "postgres: configured URL '$DB_URL' does not answer; using the local cluster at $LOCAL_DB_URL"
    if pg_answers "$LOCAL_DB_URL"; then
      PG_RESULT="$LOCAL_DB_URL (already running)"
      return 0
    fi
  fi

  local how=started t0 running=0 running_port="" changed=0
  t0=$(now)
  if pg_running; then
    running=1
    running_port=$(sed -n 4p "$PG_DATA/postmaster.pid" 2>/dev/null || true)
  fi
  if [[ $running_port != "$PG_PORT" ]] && tcp_open 127.0.0.1 "$PG_PORT"; then
    die "postgres: port 127.0.0.1:$PG_PORT is in use by a server that does not accept $LOCAL_DB_URL (not this project's cluster); set JOBSTREAM_PG_PORT or stop it"
  fi
  prepare_pg_dirs
  init_pg_cluster
  write_pg_config && changed=1

  if ((running)); then
    if ((changed)); then
      log "postgres: configuration changed; restarting the cluster"
      how=restarted
      as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w -t 60 -l "$PG_LOG" restart >"$PG_LOGDIR/pg_ctl.out" 2>&1 9>&- \
        || { show_tail "$PG_LOGDIR/pg_ctl.out"; show_tail "$PG_LOG"; die "postgres: restart failed (log: $PG_LOG)"; }
    else
      how="already running"
    fi
  else
    log "postgres: starting cluster $PG_DATA on 127.0.0.1:$PG_PORT (log $PG_LOG)"
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t 60 start >"$PG_LOGDIR/pg_ctl.out" 2>&1 9>&- \
      || { show_tail "$PG_LOGDIR/pg_ctl.out"; show_tail "$PG_LOG"; die "postgres: pg_ctl start failed (log: $PG_LOG)"; }
  fi
  ensure_pg_role_db || { show_tail "$PG_LOG"; die "postgres: could not create role/database jobstream"; }
  pg_answers "$LOCAL_DB_URL" || { show_tail "$PG_LOG"; die "postgres: cluster is up but '$LOCAL_DB_URL' does not answer"; }
  [[ $how != "already running" ]] && log "postgres: ready after $(($(now) - t0))s"
  PG_RESULT="$LOCAL_DB_URL ($how)"
}

# down_pg [immediate]: pg_ctl stop -m fast, or -m immediate (a crash: recovery on next start).
down_pg() {
  local bin mode=fast
  [[ ${1:-0} == 1 ]] && mode=immediate
  if [[ -f $PG_DATA/PG_VERSION ]] && bin=$(find_pg_bin) && PG_BIN=$bin && pg_running; then
    log "postgres: stopping cluster $PG_DATA (pg_ctl stop -m $mode)"
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m "$mode" -w -t 60 stop >/dev/null \
      || die "postgres: pg_ctl stop failed (log: $PG_LOG)"
    echo "postgres: stopped ($PG_DATA)"
  elif pg_answers "$DB_URL"; then
    echo "postgres: not started by this script; left running at $DB_URL"
  else
    echo "postgres: not running"
  fi
}

# ----------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------
take_lock() {
  mkdir -p "$JOBSTREAM_HOME"
  exec 9>"$JOBSTREAM_HOME/.services.lock"
  if ! flock -n 9; then
    log "another services.sh is running; waiting for it (up to 5 min)"
    flock -w 300 9 || die "timed out waiting for the lock $JOBSTREAM_HOME/.services.lock"
  fi
}

# Commands take an optional service (SERVICE: kafka or postgres; empty = both).
# The Connect worker is part of "all services" only with JOBSTREAM_RELAY=debezium.
with_connect() { [[ $RELAY == debezium ]]; }

cmd_up() {
  local svc=${1:-} t0
  take_lock
  t0=$(now)
  if [[ $svc == connect ]]; then
    up_connect
    log "done in $(($(now) - t0))s"
    echo "connect: $CONNECT_RESULT"
    return 0
  fi
  [[ $svc == kafka ]] || up_pg
  [[ $svc == postgres ]] || up_kafka
  if [[ -z $svc ]] && with_connect; then up_connect; fi
  log "done in $(($(now) - t0))s"
  [[ $svc == postgres ]] || echo "kafka: $KAFKA_RESULT"
  [[ $svc == kafka ]] || echo "postgres: $PG_RESULT"
  if [[ -z $svc ]] && with_connect; then echo "connect: $CONNECT_RESULT"; fi
  return 0
}

cmd_fetch() {
  local svc=${1:-}
  [[ $svc != postgres ]] || usage_error "fetch: postgres comes from apt at its start; nothing to fetch"
  take_lock
  ensure_java
  [[ $svc == connect ]] || ensure_kafka_libs
  [[ $svc == kafka ]] || ensure_connect_libs
  log "fetch: ${svc:-kafka and connect} jars in place"
}

cmd_down() {
  local svc=${1:-} immediate=${2:-0}
  take_lock
  if [[ $svc == connect ]] || { [[ -z $svc ]] && with_connect; }; then
    down_connect "$immediate"
  fi
  [[ $svc == connect ]] && return 0
  [[ $svc == postgres ]] || down_kafka "$immediate"
  [[ $svc == kafka ]] || down_pg "$immediate"
}

cmd_restart() {
  local svc=$1 immediate=${2:-0} t0
  take_lock
  # Restarting a service this script did not start would stop nothing and start nothing while
  # reporting success (a fault test would then test no fault): refuse instead.
  local foreign=
  case $svc in
    kafka) if ! kafka_our_pid >/dev/null && kafka_answers "$BOOTSTRAP"; then foreign=$BOOTSTRAP; fi ;;
    postgres) local bin; bin=$(find_pg_bin) && PG_BIN=$bin
              if ! pg_running && pg_answers "$DB_URL"; then foreign=$DB_URL; fi ;;
    connect) if ! connect_our_pid >/dev/null && connect_answers; then foreign=$CONNECT_URL; fi ;;
  esac
  [[ -z $foreign ]] || die "$svc at $foreign was not started by this script (JOBSTREAM_HOME=$JOBSTREAM_HOME): nothing to restart here; restart it with what started it, or point JOBSTREAM_HOME at its state"
  t0=$(now)
  if [[ $svc == connect ]]; then
    down_connect "$immediate"
    up_connect
    echo "connect: $CONNECT_RESULT"
  elif [[ $svc == kafka ]]; then
    down_kafka "$immediate"
    up_kafka
    echo "kafka: $KAFKA_RESULT"
  else
    down_pg "$immediate"
    up_pg
    echo "postgres: $PG_RESULT"
  fi
  log "restarted $svc in $(($(now) - t0))s"
}

cmd_status() {
  local svc=${1:-} rc=0
  if [[ $svc == connect ]] || { [[ -z $svc ]] && with_connect; }; then
    if connect_answers; then
      echo "connect: up ($CONNECT_URL)"
    else
      echo "connect: down ($CONNECT_URL)"
      rc=3
    fi
    [[ $svc == connect ]] && return "$rc"
  fi
  if [[ $svc != postgres ]]; then
    if kafka_answers "$BOOTSTRAP"; then
      echo "kafka: up ($BOOTSTRAP)"
    else
      echo "kafka: down ($BOOTSTRAP)"
      rc=3
    fi
  fi
  if [[ $svc != kafka ]]; then
    if pg_answers "$DB_URL"; then
      echo "postgres: up ($DB_URL)"
    else
      echo "postgres: down ($DB_URL)"
      rc=3
    fi
  fi
  return "$rc"
}

cmd_env() {
  printf 'export JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS=%q\n' "$BOOTSTRAP"
  printf 'export JOBSTREAM_DATABASE_URL=%q\n' "$DB_URL"
  printf 'export JOBSTREAM_CONNECT_URL=%q\n' "$CONNECT_URL"
}

usage_error() {
  printf '[services] ERROR: %s\n\n' "$*" >&2
  usage >&2
  exit 2
}

main() {
  if (($# == 0)); then
    usage >&2
    exit 2
  fi
  local cmd=$1 svc="" immediate=0 arg
  shift
  case $cmd in
    -h | --help | help) usage; return 0 ;;
    env) cmd_env; return 0 ;;
  esac
  for arg in "$@"; do
    case $arg in
      -h | --help) usage; return 0 ;;
      kafka | postgres | connect)
        [[ -z $svc ]] || usage_error "one service at a time (got $svc and $arg)"
        svc=$arg ;;
      --immediate) immediate=1 ;;
      *) usage_error "unknown argument $(printf '%q' "$arg") to $cmd" ;;
    esac
  done
  case $cmd in
    stop | down | restart) ;;
    *) ((immediate == 0)) || usage_error "--immediate only goes with stop, down or restart" ;;
  esac
  case $cmd in
    up | start) cmd_up "$svc" ;;
    down | stop) cmd_down "$svc" "$immediate" ;;
    restart)
      [[ -n $svc ]] || usage_error "restart needs a service: kafka, postgres or connect"
      cmd_restart "$svc" "$immediate" ;;
    status) cmd_status "$svc" ;;
    fetch) cmd_fetch "$svc" ;;
    *) usage_error "unknown command $(printf '%q' "$cmd")" ;;
  esac
}

main "$@"
