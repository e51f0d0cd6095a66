# Ranks out of routing during the runs of scripts/demo.sh. A shim takes its rank out of routing
# when it judges its engine down (a failed /health probe, or a run of failed requests), and a
# loaded machine can cause that by answering /health late. A policy run with fewer ranks in
# routing decodes the same requests on fewer ranks, so its imbalance, TPOT and throughput are
# not comparable with a run that had them all: the demo says so beside its comparison.

# ranks_out_of_routing: the ranks (0..G-1) whose shim has judged its engine down since it
# started (balanceroute_shim_engine_down_total > 0; the start, before the first probe answers,
# does not count), space-separated; a shim whose metrics cannot be read is listed as "<rank>?".
# Uses G, SHIMS, ADMIN_SCHEME and admin_get of scripts/lib/stack.sh.
ranks_out_of_routing() {
    local g m n out=""
    for ((g = 0; g < G; g++)); do
        if m=$(admin_get "$ADMIN_SCHEME://127.0.0.1:$((SHIMS + 2 * g + 1))/metrics"); then
            n=$(awk '/^balanceroute_shim_engine_down_total[{ ]/ { s += $NF } END { print s + 0 }' <<<"$m")
            [ "$n" = 0 ] || out="$out${out:+ }$g"
        else
            out="$out${out:+ }$g?"
        fi
    done
    echo "$out"
}

# routing_verdict G POLICY=RANKS...: one line per run (RANKS: what ranks_out_of_routing said
# for it), then, when the runs did not have the same ranks in routing, that their comparison is
# invalid.
routing_verdict() {
    local g=$1 entry policy ranks n first="" differ=0 any=0 seen=0 unread=0 w=12
    shift
    echo "ranks out of routing at any time (a shim judged its engine down: balanceroute_shim_engine_down_total):"
    # the policy column fits the longest spec
    for entry in "$@"; do
        policy=${entry%=*}
        [ "${#policy}" -le "$w" ] || w=${#policy}
    done
    for entry in "$@"; do
        # split at the last `=`: a policy spec can hold settings (NAME:key=value), the ranks
        # never do
        policy=${entry%=*}
        ranks=${entry##*=}
        n=$(wc -w <<<"$ranks")
        if [ "$n" = 1 ]; then
            printf '  %-*s 1 of %d (rank %s)\n' "$w" "$policy" "$g" "$ranks"
        elif [ "$n" = 0 ]; then
            printf '  %-*s 0 of %d\n' "$w" "$policy" "$g"
        else
            printf '  %-*s %d of %d (ranks %s)\n' "$w" "$policy" "$n" "$g" "${ranks// /, }"
        fi
        [ "$n" = 0 ] || any=1
        [[ $ranks != *"?"* ]] || unread=1
        if [ "$seen" = 0 ]; then
            first=$ranks
            seen=1
        elif [ "$ranks" != "$first" ]; then
            differ=1
        fi
    done
    if [ "$unread" = 1 ]; then
        echo "  (a rank marked ? is one whose shim's metrics could not be read: counted as out)"
    fi
    if [ "$differ" = 1 ]; then
        echo "  COMPARISON INVALID: the runs did not have the same ranks in routing, so their imbalance, TPOT"
        echo "  and throughput differ for that reason too. Run again on a quieter machine (a loaded host"
        echo "  answers the engine's /health late); the logs of those shims say why (scripts/demo.sh keeps"
        echo "  them as <policy>-shim-<rank>.log)."
        return 0
    elif [ "$any" = 1 ]; then
        echo "  every run lost the same ranks for a while: its figures are for fewer than G = $g ranks, and"
        echo "  the runs compare only as far as those ranks were out for as long in each."
    fi
}
