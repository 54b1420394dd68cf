# include(nm_lines.cmake) from a -P script, then nm_lines(<object> <variable>): the demangled symbol table of
# <object> (nm -C, with the NM the script was given), one list item per line; a failing nm fails the script.
function(nm_lines object variable)
  execute_process(COMMAND "${NM}" -C "${object}" OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} ${object} failed (${rc})")
  endif()
  string(REPLACE "\n" ";" lines "${symbols}")
  set(${variable} "${lines}" PARENT_SCOPE)
endfunction()
