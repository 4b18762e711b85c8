# The exec agent of tests/agents.rs: the turn's text says what to do.
read -r cmd arg
case "$cmd" in
  detach) echo the-real-answer; setsid sh -c "exec sleep 300 > '$arg'" & ;;
  detach-wait) setsid sh -c "exec sleep 300 > '$arg'" & wait ;;
  env) env ;;
  fail) echo "api key sk-SECRET123" >&2; exit 3 ;;
  flood) yes 0123456789 | head -c "$arg" ;;
  *) echo "$cmd $arg" ;;
esac
