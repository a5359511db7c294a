------------------------------- MODULE KVPool -------------------------------
(***************************************************************************)
(* The pool level of kvspec's reference model (kvspec/spec/model/pool.py)  *)
(* with the op domains of ``kvspec mc --level pool`` (Bounds() in          *)
(* kvspec/mc/enumerate_ops.py), for the target ``impl``: a null block,     *)
(* prefix caching on, freed blocks all go to the queue tail                *)
(* (unhashed_free_first off), no documented no-ops, the index keeps every *)
(* block of a label (no latest-wins), a freed block stays cached.          *)
(*                                                                         *)
(* The state is exactly what kvspec's state key (kvspec/mc/canonical.py,   *)
(* pool_key) tells apart for a correct target, whose observation is a      *)
(* function of the model state:                                            *)
(*   ref    the ref count of every block                                   *)
(*   hash   the label a block carries, or NoHash                           *)
(*   queue  the free queue, head (evicted first) to tail                   *)
(*   index  label -> the blocks under it, in the order they were cached   *)
(*   hist   the hash history: every label ever cached (the session's      *)
(*          HashMap, target hash <-> label; the target hash of a label is  *)
(*          fixed, so the history is the set of labels)                    *)
(* hash is a function of index; it is kept because kvspec keys on both and *)
(* the invariants read it.                                                 *)
(*                                                                         *)
(* Depth: kvspec mc --depth D expands states found within D - 1 ops and    *)
(* counts every state found within D ops. With one TLC worker the search   *)
(* is breadth-first, so TLCGet("level") (1 for an initial state) is the    *)
(* distance + 1, and guarding Next with level <= MaxDepth gives the same   *)
(* set. MaxDepth = 0 means no bound (the whole reachable space). With more *)
(* than one worker TLC's levels are not exact and a depth bound can        *)
(* undercount: compare multi-worker runs without a bound.                  *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS
    Blocks,     \* the usable blocks (model values; a symmetry set)
    NullBlock,  \* block 0: reserved, never handed out
    Labels,     \* hash labels (model values; a symmetry set)
    NoHash,     \* "no hash" (a model value outside Labels)
    MaxRef,     \* Bounds.max_ref: no ref count above this
    MaxSet,     \* Bounds.max_set: blocks per Free / Touch / Cache
    MaxDepth    \* ops per behaviour at most; 0: no bound

ASSUME /\ NoHash \notin Labels
       /\ NullBlock \notin Blocks
       /\ MaxRef \in Nat \ {0}
       /\ MaxSet \in Nat \ {0}
       /\ MaxDepth \in Nat

VARIABLES ref, hash, queue, index, hist
vars == <<ref, hash, queue, index, hist>>

AllBlocks == Blocks \cup {NullBlock}
Range(s) == {s[i] : i \in DOMAIN s}

\* Ordered sequences of distinct elements of S, of length 1 .. k.
DistinctSeqs(S, k) ==
    UNION {{f \in [1 .. n -> S] : \A i, j \in 1 .. n : i # j => f[i] # f[j]} : n \in 1 .. k}

Held == {b \in Blocks : ref[b] > 0}

\* The initial free queue: every usable block, in one fixed order (kvspec's is
\* by id; the order is a renaming of that, so the state counts are the same).
InitOrder == CHOOSE s \in [1 .. Cardinality(Blocks) -> Blocks] : Range(s) = Blocks

-----------------------------------------------------------------------------
Init ==
    /\ ref = [b \in AllBlocks |-> 0]
    /\ hash = [b \in AllBlocks |-> NoHash]
    /\ queue = InitOrder
    /\ index = [l \in Labels |-> << >>]
    /\ hist = {}

\* Alloc(n): pop n blocks from the head; a popped block loses its hash and
\* leaves the index.
Alloc(n) ==
    LET out == {queue[i] : i \in 1 .. n} IN
    /\ queue' = SubSeq(queue, n + 1, Len(queue))
    /\ ref' = [b \in AllBlocks |-> IF b \in out THEN 1 ELSE ref[b]]
    /\ hash' = [b \in AllBlocks |-> IF b \in out THEN NoHash ELSE hash[b]]
    /\ index' = [l \in Labels |-> SelectSeq(index[l], LAMBDA x : x \notin out)]
    /\ UNCHANGED hist

\* Free(s): one reference less on each block of s; those reaching 0 go to the
\* tail in the order of s, keeping their hash (they stay hittable).
Free(s) ==
    /\ ref' = [b \in AllBlocks |-> IF b \in Range(s) THEN ref[b] - 1 ELSE ref[b]]
    /\ queue' = queue \o SelectSeq(s, LAMBDA b : ref[b] = 1)
    /\ UNCHANGED <<hash, index, hist>>

\* Touch(s): one reference more; a free (cached) block leaves the queue.
Touch(s) ==
    /\ ref' = [b \in AllBlocks |-> IF b \in Range(s) THEN ref[b] + 1 ELSE ref[b]]
    /\ queue' = SelectSeq(queue, LAMBDA b : b \notin Range(s))
    /\ UNCHANGED <<hash, index, hist>>

\* Cache(s, g): block s[i] gets label g[s[i]] and is appended under it.
Cache(s, g) ==
    /\ hash' = [b \in AllBlocks |-> IF b \in Range(s) THEN g[b] ELSE hash[b]]
    /\ index' = [l \in Labels |-> index[l] \o SelectSeq(s, LAMBDA b : g[b] = l)]
    /\ hist' = hist \cup {g[b] : b \in Range(s)}
    /\ UNCHANGED <<ref, queue>>

\* Lookup(l): a query; the state does not change.
Lookup(l) == UNCHANGED vars

\* Reset: drops every hash when no block is held, else refuses.
Reset ==
    IF Held = {}
    THEN /\ hash' = [b \in AllBlocks |-> NoHash]
         /\ index' = [l \in Labels |-> << >>]
         /\ UNCHANGED <<ref, queue, hist>>
    ELSE UNCHANGED vars

\* The domains of enumerate_ops.enabled_pool_ops with Bounds() (max_holders and
\* max_alloc None, no misuse calls).
Next ==
    /\ MaxDepth = 0 \/ TLCGet("level") <= MaxDepth
    /\ \/ \E n \in 1 .. Len(queue) : Alloc(n)
       \/ \E s \in DistinctSeqs(Held, MaxSet) : Free(s)
       \/ \E s \in DistinctSeqs({b \in Blocks : (ref[b] > 0 \/ hash[b] # NoHash) /\ ref[b] < MaxRef},
                                MaxSet) : Touch(s)
       \/ \E s \in DistinctSeqs({b \in Held : hash[b] = NoHash}, MaxSet) :
             \E g \in [Range(s) -> Labels] : Cache(s, g)
       \/ \E l \in Labels : Lookup(l)
       \/ Reset

Spec == Init /\ [][Next]_vars

\* Blocks are interchangeable, and so are labels (kvspec's canonical keys).
Symm == Permutations(Blocks) \cup Permutations(Labels)

-----------------------------------------------------------------------------
(* The catalogue's pool-level invariants (kvspec/spec/invariants.py).      *)

TypeOK ==
    /\ ref \in [AllBlocks -> 0 .. MaxRef]
    /\ hash \in [AllBlocks -> Labels \cup {NoHash}]
    /\ Range(queue) \subseteq Blocks
    /\ index \in [Labels -> Seq(Blocks)]
    /\ hist \subseteq Labels

\* I1 QUEUE_IFF_FREE: a non-null block is queued iff its ref count is 0; no
\* duplicates in the queue.
I1 ==
    /\ \A b \in Blocks : (b \in Range(queue)) <=> (ref[b] = 0)
    /\ Len(queue) = Cardinality(Range(queue))

\* ACCOUNTING: the free count (the queue length) equals the number of non-null
\* ref-0 blocks; ref counts never negative.
Accounting ==
    /\ Len(queue) = Cardinality({b \in Blocks : ref[b] = 0})
    /\ \A b \in AllBlocks : ref[b] >= 0

\* INDEX_CONSISTENT: every index entry l -> b has hash[b] = l (once), and
\* every hashed block is in the index.
IndexConsistent ==
    /\ \A l \in Labels : \A i \in DOMAIN index[l] : hash[index[l][i]] = l
    /\ \A l \in Labels : Len(index[l]) = Cardinality(Range(index[l]))
    /\ \A b \in Blocks : hash[b] # NoHash => b \in Range(index[hash[b]])

\* NULL_BLOCK: the null block is never handed out, queued, hashed or indexed.
NullBlockReserved ==
    /\ ref[NullBlock] = 0
    /\ hash[NullBlock] = NoHash
    /\ NullBlock \notin Range(queue)
    /\ \A l \in Labels : NullBlock \notin Range(index[l])

\* I4 CACHED_EVICTABLE: a cached block with ref 0 stays in the queue and the
\* index (it leaves only when allocation pops it or touch revives it).
CachedEvictable ==
    \A b \in Blocks : (hash[b] # NoHash /\ ref[b] = 0) =>
        /\ b \in Range(queue)
        /\ b \in Range(index[hash[b]])

\* HASH_CHAIN at pool level: the history pairs every label on a block.
HistoryCovers == \A b \in Blocks : hash[b] # NoHash => hash[b] \in hist

\* I3 FULL_ONLY (pool level: every cached block is full): a held block's hash
\* is set once. An action property.
HashSetOnce ==
    [][\A b \in Blocks : (ref[b] > 0 /\ ref'[b] > 0 /\ hash[b] # NoHash) => hash'[b] = hash[b]]_vars

=============================================================================
