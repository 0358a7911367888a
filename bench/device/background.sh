#!/usr/bin/env bash
# A device run longer than one call (10 minutes): the first call starts the phases in a session of their own, which
# outlives the call while the machine stays warm (30 s between calls); each call then waits for them, up to a limit,
# and copies what they packed so far into the call's $OUT. The phases write into $OUT_BG (run_phases' OUT).
#
#   bench/device/background.sh start bench/run_offload_checks.sh ram-tier-reader tests   # returns at once
#   bench/device/background.sh wait 560    # until the run ends or 560 s pass; prints the log's tail, fills $OUT
set -uo pipefail
BG=${BG:-/tmp/glm53-background}
OUT_BG=${OUT_BG:-/tmp/glm53-device-out}
mkdir -p "$BG" "$OUT_BG"

case "${1:-}" in
start)
	shift
	rm -f "$BG/rc"
	OUT="$OUT_BG" setsid nohup bash -c '"$@"; echo $? > "$0/rc"' "$BG" "$@" >"$BG/log" 2>&1 </dev/null &
	echo "started $* (pid $!)"
	;;
wait)
	limit=${2:-560}
	t0=$SECONDS
	while [ ! -e "$BG/rc" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 5; done
	if [ -e "$BG/rc" ]; then echo "finished: exit $(cat "$BG/rc") after this call's $((SECONDS - t0)) s"; else echo "still running after $limit s"; fi
	tail -n 60 "$BG/log"
	if [ -n "${OUT:-}" ]; then
		cp "$OUT_BG"/*.tgz "$OUT"/ 2>/dev/null
		cp "$BG/log" "$OUT/background.log"
	fi
	;;
*)
	echo "usage: $0 start CMD... | wait [SECONDS]" >&2
	exit 2
	;;
esac
