# Runs one libFuzzer target for a bounded number of executions on a fresh copy of its corpus (ctest fuzz_run.*).
# -DFUZZER=<executable> -DCORPUS=<seed dir> -DWORK=<scratch dir> -DRUNS=<n> -DMAX_LEN=<bytes> [-DDICT=-dict=<file>]
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
file(GLOB seeds "${CORPUS}/*")
file(COPY ${seeds} DESTINATION "${WORK}")
get_filename_component(name "${WORK}" NAME)
set(artifacts "${WORK}/../artifacts_${name}/")
file(MAKE_DIRECTORY "${artifacts}")
execute_process(
  COMMAND "${FUZZER}" ${DICT} -runs=${RUNS} -seed=1 -max_len=${MAX_LEN} -timeout=60 -rss_limit_mb=4096
          -artifact_prefix=${artifacts} "${WORK}"
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "${FUZZER} failed (${result}); the crashing input is in ${artifacts}")
endif()
