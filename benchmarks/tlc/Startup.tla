------------------------------- MODULE Startup -------------------------------
(* One state, the standard modules KVPool.tla extends: a TLC run of this is   *)
(* JVM start-up + parsing + initial states, measured apart from the search.   *)
EXTENDS Naturals, Sequences, FiniteSets, TLC

VARIABLE x

Init == x = 0
Next == UNCHANGED x
=============================================================================
